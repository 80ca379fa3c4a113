"""Native matmul over GGUF's packed weight blocks (int8 activations x the file's blocks).

``matmul(x, packed, qtype)`` computes ``x (T, K) float32 @ W(N, K)^T`` where W is given as the
file's packed rows ``(N, row_bytes) uint8`` of one GGUF type, without dequantizing W: each
activation row is quantized to int8 blocks once per call, the products are integer dot
products per block, and the blocks are folded into a float sum in a fixed order (see
ggml_matmul.c).  Row i of the result is bitwise the same whatever the other rows and the thread
count, and every SIMD path (``isa()``) gives the portable C path's bits.

The library is built by ``python -m specpipe.kernels.native.build`` (install.sh does it); without
it, ``available()`` is False and ``matmul`` raises.  ``SPECPIPE_NATIVE_ISA=portable|avx2|
avx512vnni|amx|neon`` forces a path (amx: AVX-512 VNNI with Intel AMX tile multiplies for
Q4_K's larger calls; it needs Linux to grant the tile state) (it must be supported by this CPU); it is read once per process,
so that every call of a process takes the same path (``reload_isa_code()`` re-reads it).
Results and design: docs/native_kernels.md.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import gguf
import torch

_HERE = Path(__file__).resolve().parent
LIBRARY = _HERE / "libspecpipe_native.so"

_ISA_CODES = {"portable": 0, "avx2": 1, "avx512vnni": 2, "neon": 3, "amx": 4}
_ISA_NAMES = {v: k for k, v in _ISA_CODES.items()}

_Q = gguf.GGMLQuantizationType
_SUPPORTED = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K})

_ERRORS = {1: "unsupported type", 2: "bad shape", 3: "ISA not supported by this CPU",
           4: "out of memory"}
# (block values, block bytes) by type id: looked up on every call, kept off the enum machinery
_BLOCKS = {int(t): gguf.GGML_QUANT_SIZES[t] for t in _SUPPORTED}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_best_isa = 0
_supported_isa_codes: frozenset[int] = frozenset()
_process_isa: int | None = None  # the path of this process: SPECPIPE_NATIVE_ISA or the best


def _load() -> ctypes.CDLL | None:
    global _lib, _load_error
    if _lib is not None:  # the per-call path: no lock
        return _lib
    with _lock:
        if _lib is not None or _load_error is not None:
            return _lib
        if not LIBRARY.exists():
            _load_error = f"{LIBRARY.name} is not built (run python -m specpipe.kernels.native.build)"
            return None
        try:
            lib = ctypes.CDLL(str(LIBRARY))
        except OSError as e:
            _load_error = f"cannot load {LIBRARY}: {e}"
            return None
        i64, i32 = ctypes.c_int64, ctypes.c_int
        lib.sp_matmul.argtypes = [i32, ctypes.c_void_p, i64, i64, ctypes.c_void_p, i64, i64,
                                  ctypes.c_void_p, i32, i32]
        lib.sp_matmul.restype = i32
        lib.sp_attention.argtypes = [ctypes.c_void_p, i64, i32, i32, i32, ctypes.c_void_p,
                                     ctypes.c_void_p, i64, ctypes.c_void_p, ctypes.c_float,
                                     ctypes.c_void_p, i32, i32]
        lib.sp_attention.restype = i32
        lib.sp_rmsnorm.argtypes = [ctypes.c_void_p, i64, i64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
        lib.sp_rmsnorm.restype = i32
        lib.sp_rope.argtypes = [ctypes.c_void_p, i64, i64, i64, i64, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p]
        lib.sp_rope.restype = i32
        for name in ("sp_isa_supported", "sp_type_supported"):
            getattr(lib, name).argtypes = [i32]
            getattr(lib, name).restype = i32
        lib.sp_best_isa.argtypes = []
        lib.sp_best_isa.restype = i32
        lib.sp_has_openmp.argtypes = []
        lib.sp_has_openmp.restype = i32
        global _best_isa, _supported_isa_codes
        _best_isa = lib.sp_best_isa()
        _supported_isa_codes = frozenset(c for c in _ISA_CODES.values() if lib.sp_isa_supported(c))
        _lib = lib
        return lib


def available() -> bool:
    """True when the shared library is built and loads."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    _load()
    return _load_error


def _require() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"specpipe native kernels unavailable: {_load_error}")
    return lib


def supported_types() -> set[gguf.GGMLQuantizationType]:
    """The GGUF weight types ``matmul`` reads (empty when the library is not available)."""
    lib = _load()
    if lib is None:
        return set()
    return {t for t in _SUPPORTED if lib.sp_type_supported(int(t))}


def supported_isas() -> list[str]:
    """Every path this CPU can run, the portable one first."""
    lib = _require()
    return [name for name, code in _ISA_CODES.items() if lib.sp_isa_supported(code)]


def has_openmp() -> bool:
    return bool(_require().sp_has_openmp())


def _isa_code(isa: str | None) -> int:
    if isa is None and _process_isa is not None:  # the per-call path
        return _process_isa
    _require()
    return _resolve(isa) if isa is not None else reload_isa_code()


def reload_isa_code() -> int:
    """Read SPECPIPE_NATIVE_ISA again and fix this process's path (tests that set it call this;
    otherwise it is read once, so that every call in a process takes the same path)."""
    global _process_isa
    _require()
    name = os.environ.get("SPECPIPE_NATIVE_ISA", "").strip().lower()
    _process_isa = _resolve(name) if name else _best_isa
    return _process_isa


def _resolve(name: str) -> int:
    code = _ISA_CODES.get(name)
    if code is None:
        raise ValueError(f"unknown ISA {name!r}; one of {sorted(_ISA_CODES)}")
    if code not in _supported_isa_codes:
        raise ValueError(f"ISA {name!r} is not supported on this CPU/build; {supported_isas()}")
    return code


def isa() -> str:
    """The path ``matmul`` takes in this process: the best this CPU runs, or the one
    SPECPIPE_NATIVE_ISA names (read on first use; see ``reload_isa_code``)."""
    return _ISA_NAMES[_isa_code(None)]


def matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    qtype: gguf.GGMLQuantizationType,
    threads: int | None = None,
    *,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x (T, K) float32 @ W(N, K)^T`` with W the packed GGUF rows ``(N, row_bytes) uint8``.

    threads: OpenMP threads (default ``torch.get_num_threads()``); the result does not depend on
    it.  isa: force a path for this call (default: this process's, see ``isa()``).
    out: an optional (T, N) float32 tensor to write into.
    """
    lib = _lib if _lib is not None else _require()
    type_id = int(qtype)
    if type_id not in _BLOCKS:
        raise ValueError(f"native matmul does not read {gguf.GGMLQuantizationType(qtype).name}; "
                         f"supported: {sorted(t.name for t in _SUPPORTED)}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        raise TypeError(f"x must be a 2-D float32 tensor, got {getattr(x, 'dtype', type(x))} "
                        f"{tuple(getattr(x, 'shape', ()))}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"packed must be a 2-D uint8 tensor, got "
                        f"{getattr(packed, 'dtype', type(packed))} "
                        f"{tuple(getattr(packed, 'shape', ()))}")
    if not (x.is_cpu and packed.is_cpu):
        raise ValueError("native matmul runs on CPU tensors only")
    if not x.is_contiguous() or not packed.is_contiguous():
        raise ValueError("x and packed must be contiguous")
    t, k = x.shape
    n, row_bytes = packed.shape
    block, block_bytes = _BLOCKS[type_id]
    if k % block != 0:
        raise ValueError(f"K = {k} is not a multiple of the {_name(type_id)} block size {block}")
    if row_bytes != k // block * block_bytes:
        raise ValueError(f"packed rows have {row_bytes} bytes; {_name(type_id)} with K = {k} "
                         f"needs {k // block * block_bytes}")
    if out is None:
        out = torch.empty((t, n), dtype=torch.float32)
    elif (out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != t or out.shape[1] != n
          or not out.is_contiguous() or not out.is_cpu):
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {(t, n)}")
    nthreads = int(threads) if threads is not None else torch.get_num_threads()
    rc = lib.sp_matmul(type_id, x.data_ptr(), t, k, packed.data_ptr(), n, row_bytes,
                       out.data_ptr(), max(1, nthreads), _isa_code(isa))
    if rc != 0:
        raise RuntimeError(f"sp_matmul failed: {_ERRORS.get(rc, rc)}")
    return out


def matmul_checked_packed(x: torch.Tensor, packed: torch.Tensor, type_id: int, threads: int) -> torch.Tensor:
    """``matmul`` for a step's hot path (kernels/torch_kernels.NativeKernel): `packed` and
    `type_id` were checked once when the layer was built, so only x is checked here (the C side
    checks that the shapes agree)."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or not x.is_cpu:
        return matmul(x.contiguous(), packed, type_id, threads)  # the full checks, their errors
    t, k = x.shape
    n, row_bytes = packed.shape
    out = torch.empty((t, n), dtype=torch.float32)
    isa = _process_isa if _process_isa is not None else _isa_code(None)
    rc = _lib.sp_matmul(type_id, x.data_ptr(), t, k, packed.data_ptr(), n, row_bytes, out.data_ptr(),
                        threads, isa)
    if rc != 0:
        raise RuntimeError(f"sp_matmul failed: {_ERRORS.get(rc, rc)} (x {tuple(x.shape)}, "
                           f"{_name(type_id)} weight {tuple(packed.shape)})")
    return out


# Below this many multiply-adds an attention call runs on the calling thread: waking OpenMP
# threads costs more than a short decode row's attention (the result is the same either way).
# SmolLM2 (9 heads of 64) crosses it at about 230 slots; at 700 slots two threads took its
# decode attention from 5.7 to 4.2 ms per token.
_ATTENTION_THREADED_WORK = 1 << 17


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float, threads: int | None = None, *, isa: str | None = None) -> torch.Tensor:
    """Attention of q (T, Hq, D) over k, v (C, Hkv, D), mask (T, C) bool or None -> (T, Hq, D),
    all float32 CPU tensors. Each row's result depends only on the slots its mask lets it see,
    in their order: not on C, on the masked slots, on the other rows or on ``threads``."""
    lib = _lib if _lib is not None else _require()
    t, hq, d = q.shape
    c, hkv, _ = k.shape
    if not all(x.dtype == torch.float32 and x.is_cpu for x in (q, k, v)):
        raise TypeError("native attention takes float32 CPU tensors")
    if k.shape != v.shape or k.shape[2] != d or hq % hkv:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if mask is not None and tuple(mask.shape) != (t, c):
        raise ValueError(f"mask must be {(t, c)}, got {tuple(mask.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    m = None if mask is None else mask.contiguous().view(torch.uint8)
    out = torch.empty_like(q)
    if threads is None:
        threads = torch.get_num_threads() if t * hq * c * d >= _ATTENTION_THREADED_WORK else 1
    rc = lib.sp_attention(q.data_ptr(), t, hq, hkv, d, k.data_ptr(), v.data_ptr(), c,
                          None if m is None else m.data_ptr(), float(scale), out.data_ptr(),
                          max(1, int(threads)), _isa_code(isa))
    if rc != 0:
        raise RuntimeError(f"sp_attention failed: {_ERRORS.get(rc, rc)}")
    return out


def _float32_rows(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim of x (..., n), each row on
    its own (norm_rope.c). float32 contiguous CPU tensors."""
    lib = _lib if _lib is not None else _require()
    n = x.shape[-1]
    if not _float32_rows(x, weight) or weight.shape != (n,):
        raise TypeError(f"rmsnorm takes contiguous float32 CPU x (..., {n}) and weight ({n},)")
    y = torch.empty_like(x)
    rc = lib.sp_rmsnorm(x.data_ptr(), x.numel() // n, n, weight.data_ptr(), float(eps), y.data_ptr())
    if rc != 0:
        raise RuntimeError(f"sp_rmsnorm failed: {_ERRORS.get(rc, rc)}")
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings (rotate-half) of x (T, heads, D) by cos, sin (T, 1, R), R <= D: the
    first R values of each head rotate, the rest pass; bitwise the written-out torch form."""
    lib = _lib if _lib is not None else _require()
    t, heads, d = x.shape
    r = cos.shape[-1]
    if not _float32_rows(x, cos, sin) or cos.numel() != t * r or sin.numel() != t * r:
        raise TypeError(f"rope takes contiguous float32 CPU x (T, H, D) and cos, sin (T, 1, R); "
                        f"got {tuple(x.shape)}, {tuple(cos.shape)}")
    y = torch.empty_like(x)
    rc = lib.sp_rope(x.data_ptr(), t, heads, d, r, cos.data_ptr(), sin.data_ptr(), y.data_ptr())
    if rc != 0:
        raise RuntimeError(f"sp_rope failed: {_ERRORS.get(rc, rc)}")
    return y


def _name(type_id: int) -> str:
    return gguf.GGMLQuantizationType(type_id).name


__all__ = ["available", "unavailable_reason", "supported_types", "supported_isas", "isa",
           "reload_isa_code",
           "matmul", "matmul_checked_packed", "attention", "rmsnorm", "rope", "has_openmp", "LIBRARY"]
