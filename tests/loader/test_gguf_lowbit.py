"""A GGUF whose matrices use every low-bit type at once (Q2_K, Q3_K, the IQ types, MXFP4, TQ1_0,
TQ2_0), as llama.cpp's mixes and the "dynamic" quants store them, one type per tensor.

It loads with each tensor in its own type and kernel, at the file's size in memory; its greedy
tokens on the native and the portable kernel equal those of the same model dequantized to float32
at load; a file with a type SpecPipe cannot compute is refused at open, by name.  gguf-py cannot
quantize most of these types, so the blocks are random valid ones (tests/lowbit_helpers.py); the model is the tiny llama of test_gguf.py.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_gguf import HIDDEN, tiny_weights, write_gguf
from lowbit_helpers import random_blocks

from specpipe.config import StageSpec
from specpipe.kernels import native
from specpipe.kernels.ggml_types import LAYOUTS, LOWBIT_TYPES
from specpipe.kernels.qlinear import QuantEmbedding, QuantLinear
from specpipe.loader import CheckpointError, open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage, weight_kernels, weight_nbytes

Q = gguf.GGMLQuantizationType


def mixed_file(path, seed: int = 0):
    """The tiny model with its matrices in the low-bit types, round robin (norms F32); returns
    (path, {canonical name: type})."""
    rng = np.random.default_rng(seed)
    stored, types = {}, {}
    matrices = [n for n, w in tiny_weights().items() if w.ndim == 2]
    for name, w in tiny_weights().items():
        if w.ndim == 1:
            stored[name] = (w, Q.F32)
            continue
        qtype = LOWBIT_TYPES[matrices.index(name) % len(LOWBIT_TYPES)]
        rows, k = w.shape
        # a scale that keeps the residual stream in range: |w| about 1/sqrt(k)
        raw = random_blocks(qtype, rows * k // LAYOUTS[qtype].values, rng, scale=0.25 / np.sqrt(k))
        stored[name], types[name] = (raw.reshape(rows, -1), qtype), qtype
    return write_gguf(path, {}, stored=stored), types


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return mixed_file(tmp_path_factory.mktemp("lowbit") / "mixed.gguf")


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        n = len(ids)
        logits = run_rows(model, model.make_kv_cache(n), torch.tensor(ids), list(range(n)), list(range(n)),
                          list(range(n)), None)
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


def test_every_tensor_keeps_its_type(mixed):
    path, types = mixed
    assert set(types.values()) == set(LOWBIT_TYPES)  # the file holds every type
    ckpt = open_checkpoint(path)
    try:
        assert {n: ckpt.stored_type(n) for n in types} == types
        model = build_stage(ckpt, StageSpec(0, ckpt.config.num_layers, True, True), stack=False)
        held = {}
        for name, m in model.named_modules():
            if isinstance(m, (QuantLinear, QuantEmbedding)):
                held[name] = m.qtype
        assert sorted(held.values()) == sorted(types.values())
        kernels = weight_kernels(ckpt)
        assert set(kernels) == {q.name for q in LOWBIT_TYPES}
        assert set(kernels.values()) == {"native" if native.available() else "dequant"}
    finally:
        ckpt.close()


def test_a_stage_holds_the_files_bytes(mixed):
    path, _ = mixed
    ckpt = open_checkpoint(path)
    try:
        file_bytes = sum(t.n_bytes for t in ckpt._file.tensors)
        model = build_stage(ckpt, StageSpec(0, ckpt.config.num_layers, True, True))
        assert weight_nbytes(model) <= 1.05 * file_bytes, (weight_nbytes(model), file_bytes)
    finally:
        ckpt.close()


def test_greedy_tokens_equal_the_float32_models(mixed):
    """The portable kernel multiplies the reference's float32 weights: the same greedy tokens."""
    path, _ = mixed
    ckpt = open_checkpoint(path)
    try:
        spec = StageSpec(0, ckpt.config.num_layers, True, True)
        prompt = [1, 17, 42, 99, 3, 64, 5]
        want = greedy(build_stage(ckpt, spec, kernel="float32"), prompt, 12)
        model = build_stage(ckpt, spec, kernel="dequant")
        assert {m.kernel for m in model.modules() if isinstance(m, QuantLinear)} == {"dequant"}
        assert len(set(want)) > 1  # not a degenerate model
        assert greedy(model, prompt, 12) == want
    finally:
        ckpt.close()


@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_native_tokens_follow_the_float32_model(mixed):
    """The native kernel rounds each activation row to int8 blocks (as llama.cpp does), so a
    near-tie can go either way: along the float32 model's greedy sequence, every position whose
    top two float32 logits are further apart than the two paths' logits differ there gets the
    same argmax, and most positions are such (this random model amplifies differences: Q4_K and
    Q8_0 weights differ as much from float32 here)."""
    path, _ = mixed
    ckpt = open_checkpoint(path)
    try:
        spec = StageSpec(0, ckpt.config.num_layers, True, True)
        ref_model = build_stage(ckpt, spec, kernel="float32")
        prompt = [1, 17, 42, 99, 3, 64, 5]
        ids = prompt + greedy(ref_model, prompt, 24)
        model = build_stage(ckpt, spec, kernel="native")
        assert {m.kernel for m in model.modules() if isinstance(m, QuantLinear)} == {"native"}
        n = len(ids)

        def logits(m):
            return run_rows(m, m.make_kv_cache(n), torch.tensor(ids), list(range(n)), list(range(n)),
                            list(range(n)), None)[len(prompt) - 1:]

        want, got = logits(ref_model), logits(model)
        top2 = want.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (want - got).abs().amax(-1)
        assert int(clear.sum()) >= len(clear) // 2, f"only {int(clear.sum())} of {len(clear)} positions are clear"
        assert torch.equal(want.argmax(-1)[clear], got.argmax(-1)[clear])
    finally:
        ckpt.close()


def test_an_unknown_type_is_refused_at_open_by_name(tmp_path):
    w = tiny_weights()
    stored = {n: (v, Q.F32) for n, v in w.items()}
    q8_1 = np.zeros((HIDDEN, HIDDEN // 32 * 40), np.uint8)  # Q8_1: activations' type, never weights'
    stored["layers.1.mlp.up_proj.weight"] = (np.zeros((512, HIDDEN // 32 * 40), np.uint8), Q.Q8_1)
    stored["layers.0.self_attn.o_proj.weight"] = (q8_1, Q.Q8_1)
    path = write_gguf(tmp_path / "q8_1.gguf", {}, stored=stored)
    with pytest.raises(CheckpointError, match=r"cannot compute: Q8_1 \(2 tensors, e\.g\. blk\.0\.attn_output\.weight\)"):
        open_checkpoint(path)
