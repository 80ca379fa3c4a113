"""Checkpoint variants the tests build from the tiny models."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file


def bf16_copy(src, dst):
    """A copy of the Hugging Face directory `src` at `dst` with its weights stored as bfloat16."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({n: t.to(torch.bfloat16) for n, t in load_file(f).items()}, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return dst
