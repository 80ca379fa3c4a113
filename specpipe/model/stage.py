"""Build one pipeline stage's model from a checkpoint, loading only that stage's tensors."""

from __future__ import annotations

import torch

from specpipe.config import StageSpec
from specpipe.loader.checkpoint import Checkpoint, CheckpointError
from specpipe.model.llama import LlamaStage, rope_inv_freq


def checkpoint_name(param_name: str, ckpt_names: set[str]) -> str:
    # A tied LM head has no tensor of its own: it is the embedding matrix.
    if param_name == "lm_head.weight" and param_name not in ckpt_names:
        return "embed_tokens.weight"
    return param_name


def build_stage(ckpt: Checkpoint, spec: StageSpec, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> LlamaStage:
    """A `LlamaStage` for `spec` with its weights copied from `ckpt`, every shape checked."""
    with torch.device("meta"):
        model = LlamaStage(ckpt.config, spec)
    model = model.to_empty(device=device)
    if spec.first and spec.last and ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty() does not keep the tie
    # Buffers built on the meta device hold no values: recompute the RoPE table for real.
    model.inv_freq.copy_(rope_inv_freq(ckpt.config))
    available = ckpt.names()
    for name, param in model.named_parameters():
        src = checkpoint_name(name, available)
        if src not in available:
            raise CheckpointError(f"{ckpt.path.name}: tensor {src!r} is missing from the checkpoint")
        shape = tuple(ckpt.shape(src))
        if shape != tuple(param.shape):
            raise CheckpointError(
                f"{ckpt.path.name}: tensor {src!r} has shape {shape}, the model config expects "
                f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(ckpt.load(src).to(dtype))
    return model.eval().requires_grad_(False)

