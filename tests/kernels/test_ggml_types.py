"""The reference dequantize against gguf-py's, bitwise, on quantized, real and random blocks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specpipe.loader.default_model import default_model_path
from specpipe.kernels.ggml_types import BLOCKS, dequantize, row_bytes

Q = gguf.GGMLQuantizationType
ENCODABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of the f16 scale fields in a K-quant block (kept finite in random blocks).
F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def check(raw: np.ndarray, qtype: Q) -> None:
    ours = dequantize(torch.from_numpy(raw), qtype)
    theirs = gguf.quants.dequantize(raw, qtype).reshape(ours.shape)
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))  # bitwise, NaN-free


@pytest.mark.parametrize("qtype", ENCODABLE, ids=lambda q: q.name)
def test_quantized_random_data(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((7, 512)) * rng.uniform(0.01, 3, (7, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype).view(np.uint8).reshape(7, -1)  # F16/F32 come back typed
    assert raw.shape == (7, row_bytes(qtype, 512))
    check(raw, qtype)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_random_k_quant_blocks(qtype):
    # gguf-py cannot encode K-quants: random bytes are valid blocks except for f16 fields
    # that would be inf/NaN, so those get random finite halves.
    bs, ts = BLOCKS[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, (5, 4 * ts), dtype=np.uint8)
    blocks = raw.reshape(-1, ts)
    for off in F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = rng.uniform(-2, 2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    check(raw, qtype)


def test_some_rows_alone():
    rng = np.random.default_rng(1)
    raw = gguf.quants.quantize(rng.standard_normal((9, 64)).astype(np.float32), Q.Q4_1)
    full = dequantize(torch.from_numpy(raw), Q.Q4_1)
    rows = torch.tensor([7, 2, 2])
    assert torch.equal(dequantize(torch.from_numpy(raw)[rows], Q.Q4_1), full[rows])


def first_rows_of_each_type(path) -> set:
    reader = gguf.GGUFReader(path)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]) if len(t.shape) > 1 else 1, -1)[:64]
        check(np.array(raw), t.tensor_type)
    return seen


def test_real_tensors_of_the_default_model():
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= first_rows_of_each_type(default_model_path())


def test_real_k_quant_tensors():
    path = Path.home() / ".cache/specpipe/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip("Qwen2.5-Coder-1.5B Q4_K_M is not downloaded")
    assert {Q.Q4_K, Q.Q6_K} <= first_rows_of_each_type(path)
