"""The native library's boundary (issue 45): every shape checked before C writes anything, range
checks that cannot wrap, masks and slots checked in Python where C cannot see their size or
dtype, a rebuild that leaves a loaded library intact, a stale library refused with one warning,
and the block layouts of kernels/ggml_types.py checked against the C structs.  Each input here
crashed, read past a buffer or gave wrong results before; docs/native_kernels.md, "The
boundary", records a run of this file against the AddressSanitizer build."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import warnings

import gguf
import numpy as np
import pytest
import torch

from specpipe.kernels import ggml_types, native
from specpipe.kernels.native import build as native_build
from specpipe.kernels.native import layer as native_layer
from specpipe.model.attention import Segment

Q = gguf.GGMLQuantizationType
INT64_MAX = 2**63 - 1
SHAPE = 2  # ggml_matmul.h SP_ERR_SHAPE

needs_lib = pytest.mark.skipif(not native.available(), reason="native kernels not built")

# A small layer: hidden 64, 4 query heads and 2 KV heads of 16, MLP 128; Q8_0 weights.
HIDDEN, INTER, HQ, HKV, D = 64, 128, 4, 2, 16


def q8_rows(n: int, k: int, seed: int) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, Q.Q8_0)))


def proj(n: int, k: int, seed: int) -> native_layer.Projection:
    return native_layer.Projection(q8_rows(n, k, seed), int(Q.Q8_0), None)


def weights(**override) -> native_layer.LayerWeights:
    parts = dict(qkv=[proj((HQ + 2 * HKV) * D, HIDDEN, 1)], o=proj(HIDDEN, HQ * D, 2),
                 gate_up=[proj(2 * INTER, HIDDEN, 3)], down=proj(HIDDEN, INTER, 4))
    parts.update(override)
    return native_layer.LayerWeights(hidden=HIDDEN, inter=INTER, hq=HQ, hkv=HKV, d=D, eps=1e-5, scale=None,
                                     in_norm=torch.ones(HIDDEN), post_norm=torch.ones(HIDDEN), **parts)


def segment(start: int, end: int, slots, *, read_range=None, mask=None) -> Segment:
    return Segment(start, end, torch.as_tensor(slots, dtype=torch.int64), read_range, mask)


def run_layer(w, segs, *, t: int = 2, slots: int = 8, write=None):
    """One call on t rows; returns (result or the exception, the caches afterwards)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, HIDDEN, generator=gen)
    cos, sin = torch.ones(t, 1, D), torch.zeros(t, 1, D)
    kc, vc = torch.zeros(slots, HKV, D), torch.zeros(slots, HKV, D)
    write = torch.arange(t, dtype=torch.int64) if write is None else torch.as_tensor(write, dtype=torch.int64)
    try:
        out = native_layer.decoder_layer(w, x, cos, sin, kc, vc, write, native_layer.Segments(segs), threads=1)
    except (RuntimeError, ValueError, TypeError) as e:
        out = e
    return out, kc, vc


# ---------------------------------------------------------------- 1. shapes before any write


@needs_lib
def test_the_layer_runs_on_well_formed_input():
    out, kc, _ = run_layer(weights(), [segment(0, 2, [0, 1], read_range=(0, 2))])
    assert isinstance(out, torch.Tensor) and out.shape == (2, HIDDEN) and torch.isfinite(out).all()
    assert kc[:2].any() and not kc[2:].any()


@needs_lib
@pytest.mark.parametrize("part, bad", [
    ("o", lambda: proj(HIDDEN + 32, HQ * D, 2)),          # o rows past the scratch
    ("o", lambda: proj(HIDDEN, HQ * D + 32, 2)),          # o rows of the wrong width
    ("down", lambda: proj(4 * HIDDEN, INTER, 4)),         # down rows past the scratch
    ("down", lambda: proj(HIDDEN, HIDDEN, 4)),            # down reading `hidden` inputs, not inter
    ("qkv", lambda: [proj(HQ * D, HIDDEN, 1)]),           # q only: k, v missing
    ("gate_up", lambda: [proj(2 * INTER, INTER, 3)]),     # gate/up reading the wrong width
])
def test_a_misshaped_projection_is_a_python_error(part, bad):
    with pytest.raises(ValueError, match=part.replace("_", "/") if part != "qkv" else "q/k/v"):
        weights(**{part: bad()})


@needs_lib
@pytest.mark.parametrize("field, value", [("o.n", 16 * HIDDEN), ("down.n", 16 * HIDDEN), ("o.row_bytes", 34),
                                          ("qkv0.n", 4096), ("gu0.row_bytes", 0), ("o.type", 99),
                                          ("hq", 65 * HKV)])
def test_a_misshaped_descriptor_is_refused_in_c_before_any_write(field, value):
    """The C side checks the descriptor itself (a caller other than LayerWeights, or one changed
    after it was checked): it used to write the caches and then project o or down into a scratch
    sized by q/k/v and gate/up only, past its end."""
    w = weights()
    target, name = w.c, field
    if "." in field:
        part, name = field.split(".")
        target = getattr(w.c, part) if part in ("o", "down") else getattr(w.c, part[:-1])[int(part[-1])]
    setattr(target, name, value)
    out, kc, vc = run_layer(w, [segment(0, 2, [0, 1], read_range=(0, 2))])
    assert isinstance(out, RuntimeError) and "bad shape" in str(out)
    assert not kc.any() and not vc.any()  # nothing written


# ---------------------------------------------------------------- 2. range checks that cannot wrap


@needs_lib
@pytest.mark.parametrize("first", [INT64_MAX - 1, INT64_MAX - 8, 2**62, -1, 7])
def test_a_read_range_past_the_cache_is_refused(first):
    """first + c > num_slots tested in int64 wrapped for a first near INT64_MAX: the layer read
    the cache at first * nkv floats."""
    out, kc, _ = run_layer(weights(), [segment(0, 2, [0, 1], read_range=(first, first + 2))])
    assert isinstance(out, RuntimeError) and "slot" in str(out)
    assert not kc.any()


@needs_lib
@pytest.mark.parametrize("write, read", [([0, INT64_MAX], [0, 1]), ([0, -1], [0, 1]), ([0, 1], [0, INT64_MAX]),
                                         ([0, 1], [-(2**63), 1])])
def test_slots_out_of_range_are_refused(write, read):
    out, kc, _ = run_layer(weights(), [segment(0, 2, read)], write=write)
    assert isinstance(out, RuntimeError) and not kc.any()


@needs_lib
def test_segments_that_do_not_cover_the_rows_are_refused():
    for segs in ([segment(0, 1, [0])], [segment(0, 3, [0, 1])], [segment(1, 2, [0]), segment(0, 1, [0])]):
        out, kc, _ = run_layer(weights(), segs)
        assert isinstance(out, RuntimeError) and not kc.any()


@needs_lib
def test_sizes_that_would_wrap_are_refused_in_c():
    """Called as any C caller could: numbers whose products wrap int64 get SP_ERR_SHAPE, before
    any buffer is touched (the buffers here hold a few floats)."""
    lib = native._lib
    buf = torch.zeros(64)
    p = buf.data_ptr()
    packed = torch.zeros(4, dtype=torch.uint8)
    # Q8_0 rows of k values: k / 32 * 34 bytes; with k near 2^63 that wraps, and the wrapped
    # value once passed for row_bytes
    k = 32 * (INT64_MAX // 32)
    wrapped = ctypes.c_int64((k // 32 * 34) & (2**64 - 1)).value
    assert lib.sp_matmul(int(Q.Q8_0), p, 1, k, packed.data_ptr(), 1, wrapped, p, 1, 0) == SHAPE
    assert lib.sp_matmul(int(Q.Q8_0), p, 2**62, 32, packed.data_ptr(), 2**62, 34, p, 1, 0) == SHAPE
    # attention over 2^62 slots (its scratch size wrapped), or t * hq * d past int64
    assert lib.sp_attention(p, 1, 1, 1, 16, p, p, 2**62, None, 1.0, p, 1, 0) == SHAPE
    assert lib.sp_attention(p, 2**62, 8, 8, 16, p, p, 1, None, 1.0, p, 1, 0) == SHAPE
    assert lib.sp_rmsnorm(p, 2**62, 4, p, 1e-5, p) == SHAPE
    assert lib.sp_rope(p, 2**62, 4, 16, 16, p, p, p) == SHAPE


# ---------------------------------------------------------------- 3. masks and slots at the boundary


@needs_lib
@pytest.mark.parametrize("mask, error", [
    (torch.ones(1, 2, dtype=torch.bool), ValueError),     # short: C read 2 x 2 bytes from 2
    (torch.ones(2, 1, dtype=torch.bool), ValueError),
    (torch.ones(2, 2, dtype=torch.int64), TypeError),     # read as bytes: 0 1 0 0 ...
    (torch.ones(2, 2, dtype=torch.float32), TypeError),
    (torch.ones(4, dtype=torch.bool), ValueError),
])
def test_a_wrong_mask_is_refused(mask, error):
    with pytest.raises(error, match="mask"):
        native_layer.Segments([segment(0, 2, [0, 1], mask=mask)])
    q, kv = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(error, match="mask"):
        native.attention(q, kv, kv, mask, 0.25)


@needs_lib
def test_wrong_slots_are_refused():
    with pytest.raises(TypeError, match="read_slots"):
        native_layer.Segments([Segment(0, 2, torch.tensor([0, 1], dtype=torch.int32), None, None)])
    with pytest.raises(TypeError, match="read_slots"):
        native_layer.Segments([Segment(0, 2, torch.tensor([[0, 1]]), None, None)])
    with pytest.raises(TypeError, match="read_slots"):
        native_layer.Segments([Segment(0, 2, torch.tensor([], dtype=torch.int64), None, None)])
    with pytest.raises(ValueError, match="read_range"):
        native_layer.Segments([segment(0, 2, [0, 1], read_range=(0, 5))])
    with pytest.raises(ValueError, match="rows"):
        native_layer.Segments([segment(2, 1, [0])])


@needs_lib
def test_a_noncontiguous_or_uint8_mask_reads_as_its_bool_values():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    mask = torch.rand(5, 3, generator=gen) > 0.4
    mask[0] = True
    want = native.attention(q, k, v, mask.t().contiguous(), 0.25)
    assert torch.equal(native.attention(q, k, v, mask.t(), 0.25), want)  # a transposed view
    assert torch.equal(native.attention(q, k, v, mask.t().to(torch.uint8), 0.25), want)
    out, _, _ = run_layer(weights(), [segment(0, 2, [0, 1], mask=torch.tril(torch.ones(2, 2, dtype=torch.bool)).t().t())])
    assert isinstance(out, torch.Tensor)


@needs_lib
def test_more_than_64_query_heads_per_kv_head_is_an_error():
    q, kv = torch.randn(1, 65, 16), torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="64"):
        native.attention(q, kv, kv, None, 0.25)
    with pytest.raises(ValueError, match="64"):
        native_layer.LayerWeights(hidden=HIDDEN, inter=INTER, hq=65, hkv=1, d=32, eps=1e-5, scale=None,
                                  in_norm=torch.ones(HIDDEN), post_norm=torch.ones(HIDDEN),
                                  qkv=[proj(67 * 32, HIDDEN, 1)], o=proj(HIDDEN, 65 * 32, 2),
                                  gate_up=[proj(2 * INTER, HIDDEN, 3)], down=proj(HIDDEN, INTER, 4))


# ---------------------------------------------------------------- 4. a rebuild under a running process

PROBE_C = "int sp_probe(void) { return PROBE; }\n"

HOLDER = textwrap.dedent("""
    import ctypes, os, sys
    lib = ctypes.CDLL(sys.argv[1])
    print(lib.sp_probe(), os.stat(sys.argv[1]).st_ino, flush=True)
    sys.stdin.readline()
    print(lib.sp_probe(), flush=True)  # the mapping of the file it loaded, after the rebuild
""")


def test_a_rebuild_leaves_a_loaded_library_intact(tmp_path, monkeypatch):
    """build() writes a temporary file in the library's own directory and renames it over the
    library: a process that loaded the old one keeps the old file.  (It used to move from
    TMPDIR, which on a tmpfs is another filesystem: the move copied into the old file in place,
    under the process's mappings.)"""
    if native_build._compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "probe.c"
    src.write_text(PROBE_C)
    lib = tmp_path / "lib" / "libprobe.so"
    assert native_build.build(quiet=True, out=lib, sources=[src], extra_flags=["-DPROBE=1", "-O0"]) == lib
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lib)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        value, inode = map(int, holder.stdout.readline().split())
        assert value == 1
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
        monkeypatch.setenv("TMPDIR", shm)  # the temporary directory on another filesystem
        monkeypatch.setattr("tempfile.tempdir", None)
        assert native_build.build(quiet=True, out=lib, sources=[src], extra_flags=["-DPROBE=2", "-O0"]) == lib
        assert os.stat(lib).st_ino != inode  # a new file, not the old one rewritten
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert int(holder.stdout.readline()) == 1 and holder.wait(timeout=30) == 0
    finally:
        holder.kill()
        holder.wait()
    assert ctypes.CDLL(str(lib)).sp_probe() == 2
    assert [p.name for p in lib.parent.iterdir()] == ["libprobe.so"]  # no temporary file left


# ---------------------------------------------------------------- 5. a stale library


def stub_library(tmp_path, name: str, body: str) -> str:
    """A library built from C `body` (stand-ins for the real functions)."""
    if native_build._compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / f"{name}.c"
    src.write_text("#include <stdint.h>\n#include <stdio.h>\n" + body)
    out = native_build.build(quiet=True, out=tmp_path / f"{name}.so", sources=[src], extra_flags=["-O0"])
    assert out is not None
    return str(out)


def all_functions(version: int, layout: str | None = None) -> str:
    names = [n for n in native._SIGNATURES if n not in ("sp_abi_version", "sp_block_layout")]
    body = "".join(f"int {n}(void) {{ return 0; }}\n" for n in names)
    body += f"int sp_abi_version(void) {{ return {version}; }}\n"
    if layout is None:
        return body + "int sp_block_layout(int t, char *b, int64_t n) { return 1; }\n"
    return body + f'int sp_block_layout(int t, char *b, int64_t n) {{ snprintf(b, n, "{layout}"); return 0; }}\n'


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader as in a new process, restored afterwards."""
    for name, value in (("_lib", None), ("_load_error", None), ("_process_isa", None),
                        ("_best_isa", 0), ("_supported_isa_codes", frozenset()),
                        ("_refused", False), ("_reported", False)):
        monkeypatch.setattr(native, name, value)
    return monkeypatch


@pytest.mark.parametrize("case", ["older", "version", "layout"])
def test_a_stale_library_falls_back_with_one_warning(tmp_path, fresh_loader, case):
    """A library built from older sources lacked functions the bindings declare, and the load
    raised AttributeError from available(): now it is refused with one warning that names the
    rebuild command, and the portable path runs."""
    body = {"older": "int sp_matmul(void) { return 0; }\nint sp_best_isa(void) { return 0; }\n",
            "version": all_functions(1),
            "layout": all_functions(native.ABI_VERSION, "32 18 d:0:2 qs:2:16")}[case]
    path = stub_library(tmp_path, f"stale_{case}", body)
    fresh_loader.setenv("SPECPIPE_NATIVE_LIBRARY", path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not native.available() and not native.available()
        assert not native_layer.available()
        assert native.supported_types() == set()
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "python3 -m specpipe.kernels.native.build" in message and "install.sh" in message
    assert {"older": "lacks", "version": "ABI version 1", "layout": "blocks are"}[case] in message
    assert native.unavailable_reason() and "rebuild" in native.unavailable_reason()
    with pytest.raises(RuntimeError, match="unavailable"):
        native.matmul(torch.zeros(1, 32), torch.zeros(1, 34, dtype=torch.uint8), Q.Q8_0)


def test_a_missing_library_is_not_a_warning(tmp_path, fresh_loader):
    fresh_loader.setenv("SPECPIPE_NATIVE_LIBRARY", str(tmp_path / "none.so"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not native.available()
    assert not caught and "not built" in native.unavailable_reason()


@needs_lib
def test_the_built_library_passes_the_load_checks():
    lib, why = native.open_library(native.library_path())
    assert lib is not None and why is None
    assert lib.sp_abi_version() == native.ABI_VERSION


# ---------------------------------------------------------------- the block layouts, described once


@needs_lib
@pytest.mark.parametrize("qtype", sorted(ggml_types.LAYOUTS))
def test_block_layouts_match_the_c_structs(qtype):
    buf = ctypes.create_string_buffer(512)
    assert native._lib.sp_block_layout(int(qtype), buf, len(buf)) == 0
    assert buf.value.decode() == ggml_types.layout_text(qtype)
    assert ggml_types.BLOCKS[qtype] == gguf.GGML_QUANT_SIZES[qtype]
    lay = ggml_types.LAYOUTS[qtype]
    ends = [off + n for off, n in lay.fields.values()]
    assert [off for off, _ in lay.fields.values()] == [0, *ends[:-1]] and ends[-1] == lay.size  # no gaps
    # a buffer too small is an error, not an overflow
    small = ctypes.create_string_buffer(8)
    assert native._lib.sp_block_layout(int(qtype), small, len(small)) == SHAPE
