"""The low-bit GGUF types (Q2_K, Q3_K, the IQ types, MXFP4, TQ1_0, TQ2_0), per type:

* the grids and sign tables held in C (native/ggml_grids.h) equal gguf-py's, entry by entry;
* the reference dequantize (kernels/ggml_lowbit.py) is bitwise gguf.quants.dequantize on random
  blocks, extreme scales included;
* the native matmul is within the activation quantization's bound of the reference-dequantized
  float product, bitwise the same on every ISA path this CPU runs and for 1, 2 and 3 threads, and
  a row's result does not depend on the rows beside it (1, 7, 9, 17 and 64 rows);
* the portable `dequant` kernel gives the reference's products and is batch-invariant too;
* odd shapes are refused.

gguf-py quantizes none of these types except MXFP4, TQ1_0 and TQ2_0, so the weights are random
bytes (every byte pattern is a valid block) with the f16 / E8M0 scale fields kept finite.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from lowbit_helpers import random_blocks

from specpipe.kernels import native
from specpipe.kernels.ggml_lowbit import c_tables
from specpipe.kernels.ggml_types import LAYOUTS, LOWBIT_TYPES, dequantize
from specpipe.kernels.torch_kernels import DequantKernel

pytestmark = pytest.mark.usefixtures("split_every_call")  # tests/conftest.py

Q = gguf.GGMLQuantizationType
TYPES = list(LOWBIT_TYPES)
needs_native = pytest.mark.skipif(not native.available(), reason=f"native library not built: {native.unavailable_reason()}")
# values per activation scale in the native kernel (the accuracy bound's block)
ACT_BLOCK = {Q.IQ4_NL: 32, Q.MXFP4: 32, Q.IQ4_XS: 32}


def random_rows(qtype: Q, n: int, k: int, seed: int, **kw) -> np.ndarray:
    bs = LAYOUTS[qtype].values
    return random_blocks(qtype, n * k // bs, np.random.default_rng(seed), **kw).reshape(n, -1)


def assert_bitwise(ours: torch.Tensor, theirs: np.ndarray) -> None:
    theirs = np.ascontiguousarray(theirs, np.float32).reshape(ours.shape)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


# --- the tables ---------------------------------------------------------------------------

GRIDS = [("sp_iq2xxs_grid", quants.IQ2_XXS), ("sp_iq2xs_grid", quants.IQ2_XS), ("sp_iq2s_grid", quants.IQ2_S),
         ("sp_iq3xxs_grid", quants.IQ3_XXS), ("sp_iq3s_grid", quants.IQ3_S), ("sp_iq1s_grid", quants.IQ1_S)]


@pytest.mark.parametrize("name,cls", GRIDS, ids=[g[0] for g in GRIDS])
def test_c_grids_are_gguf_pys(name, cls):
    cls.init_grid()
    ours = c_tables()[name]
    theirs = cls.grid.reshape(cls.grid_shape)
    assert tuple(ours.shape) == cls.grid_shape
    ours = ours.view(torch.int8) if name == "sp_iq1s_grid" else ours
    assert np.array_equal(ours.numpy().astype(np.float32), theirs)


def test_c_sign_and_value_tables_are_gguf_pys():
    t = c_tables()
    assert bytes(t["sp_ksigns_iq2xs"].numpy()) == quants.IQ2_XXS.ksigns
    assert all(v == (i | (bin(i).count("1") & 1) << 7) for i, v in enumerate(t["sp_ksigns_iq2xs"].tolist()))
    assert t["sp_kvalues_iq4nl"].tolist() == list(quants.IQ4_NL.kvalues)
    assert t["sp_kvalues_mxfp4"].tolist() == list(quants.MXFP4.kvalues)


# --- the reference dequantize ------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("extreme", [False, True], ids=["scales", "extreme"])
def test_dequantize_is_gguf_pys_bitwise(qtype, extreme):
    raw = random_rows(qtype, 6, 1024, seed=int(qtype) + 7 * extreme, scale=2.0, extreme=extreme)
    with np.errstate(over="ignore", invalid="ignore"):  # extreme MXFP4 exponents overflow to inf in both
        theirs = quants.dequantize(raw, qtype)
    assert_bitwise(dequantize(torch.from_numpy(raw), qtype), theirs)


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.TQ1_0, Q.TQ2_0], ids=lambda q: q.name)
def test_dequantize_of_quantized_data(qtype):
    rng = np.random.default_rng(3)
    raw = quants.quantize(rng.standard_normal((5, 512)).astype(np.float32), qtype)
    assert_bitwise(dequantize(torch.from_numpy(raw), qtype), quants.dequantize(raw, qtype))


# --- the native matmul -------------------------------------------------------------------

def reference(x: torch.Tensor, packed: np.ndarray, qtype: Q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 x @ dequantize(W)^T, the element-wise bound of the int8 activations' rounding
    (tests/kernels/test_native.py says why), and |x| @ |W|^T."""
    w = dequantize(torch.from_numpy(packed), qtype).double()
    xd = x.double()
    block = ACT_BLOCK.get(qtype, 256)
    t, k = x.shape
    amax = xd.abs().reshape(t, k // block, block).amax(-1, keepdim=True).expand(-1, -1, block)
    bound = amax.reshape(t, k) @ w.abs().T / 254.0
    scale = xd.abs() @ w.abs().T
    return xd @ w.T, bound * 1.001 + 1e-5 * scale + 1e-30, scale


@needs_native
def test_the_library_reads_every_low_bit_type():
    assert set(TYPES) <= native.supported_types()


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_against_the_reference(qtype):
    k = 768
    packed = random_rows(qtype, 19, k, seed=int(qtype))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    x[1] *= 1e-3
    ref, bound, scale = reference(x, packed, qtype)
    y = native.matmul(x, torch.from_numpy(packed), qtype)
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert (err / scale).max().item() < 1e-2


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_isa_and_thread_count_gives_the_portable_bits(qtype):
    packed = torch.from_numpy(random_rows(qtype, 21, 512, seed=5))
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(2))
    want = native.matmul(x, packed, qtype, isa="portable", threads=1)
    for isa in native.supported_isas():
        for threads in (1, 2, 3):
            assert torch.equal(native.matmul(x, packed, qtype, isa=isa, threads=threads), want), (isa, threads)
        assert torch.equal(native.matmul(x[4:5], packed, qtype, isa=isa), want[4:5]), isa  # one row


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_batch_invariance(qtype):
    packed = torch.from_numpy(random_rows(qtype, 17, 512, seed=11))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 512, generator=g)
    full = native.matmul(x, packed, qtype)
    rng = np.random.default_rng(5)
    for t in (1, 7, 9, 17, 64):
        others = torch.randn(t - 1, 512, generator=g) * float(rng.uniform(0.1, 10))
        pos = int(rng.integers(0, t))
        batch = torch.cat([others[:pos], x[5:6], others[pos:]])
        assert torch.equal(native.matmul(batch, packed, qtype)[pos], full[5]), t


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_extreme_blocks_every_path(qtype):
    """Huge, tiny, zero and negative scales, every value byte pattern: each path the portable bits."""
    packed = torch.from_numpy(random_rows(qtype, 9, 512, seed=13, extreme=True))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3)) * 100
    x[1] = 127.0  # activations at the int8 extremes
    x[2, ::2] = -127.0
    want = native.matmul(x, packed, qtype, isa="portable")
    for isa in native.supported_isas():
        got = native.matmul(x, packed, qtype, isa=isa)
        assert np.array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32)), isa  # NaN/inf too


GRID_TYPES = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS, Q.IQ1_S, Q.IQ1_M, Q.IQ2_S, Q.IQ3_S]


@needs_native
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda q: q.name)
def test_every_grid_entry_and_sign_pattern_every_path(qtype):
    """The SIMD unpackings of the grid types (grid entries loaded a sub-block at a time, the
    signs made from their bits in registers) give the portable bits on 1024 random blocks: 32768
    groups, so that every grid index (IQ1's 2048 too), every 7-bit sign index and every scale
    and delta occur, for one activation row and for eight."""
    k = 4096
    packed = torch.from_numpy(random_rows(qtype, 64, k, seed=23))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(6))
    for t in (1, 8):
        want = native.matmul(x[:t], packed, qtype, isa="portable")
        for isa in native.supported_isas():
            assert torch.equal(native.matmul(x[:t], packed, qtype, isa=isa), want), (isa, t)


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_odd_shapes_are_refused(qtype):
    bs = LAYOUTS[qtype].values
    packed = torch.from_numpy(random_rows(qtype, 3, 256, seed=1))
    with pytest.raises(ValueError, match="not a multiple"):
        native.matmul(torch.zeros(1, 256 + bs // 2), packed, qtype)
    with pytest.raises(ValueError, match="packed rows have"):
        native.matmul(torch.zeros(1, 512), packed, qtype)
    assert native.matmul(torch.zeros(0, 256), packed, qtype).shape == (0, 3)


# --- the portable kernel -----------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequant_kernel_products_and_batch_invariance(qtype):
    kern = DequantKernel()
    assert kern.supports(qtype, "cpu")
    packed = torch.from_numpy(random_rows(qtype, 40, 512, seed=17))
    prepared = kern.prepare(packed, qtype, 40, 512)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(4))
    full = kern.matmul(x, prepared)
    ref = x.double() @ dequantize(packed, qtype).double().T
    assert torch.allclose(full.double(), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    for i in (0, 8):
        assert torch.equal(kern.matmul(x[i:i + 1], prepared)[0], full[i])
