"""Native matmul over GGUF's packed weight blocks (int8 activations x the file's blocks).

``matmul(x, packed, qtype)`` computes ``x (T, K) float32 @ W(N, K)^T`` where W is given as the
file's packed rows ``(N, row_bytes) uint8`` of one GGUF type, without dequantizing W: each
activation row is quantized to int8 blocks once per call, the products are integer dot
products per block, and the blocks are folded into a float sum in a fixed order (see
ggml_matmul.c).  Row i of the result is bitwise the same whatever the other rows and the thread
count, and every SIMD path (``isa()``) gives the portable C path's bits.

The library is built by ``python -m specpipe.kernels.native.build`` (install.sh does it); without
it, ``available()`` is False and ``matmul`` raises; the CLI, the server and ``LLM(...)`` then say
once per process what that costs and what to do (``report_unavailable``).  ``SPECPIPE_NATIVE_LIBRARY=<path>`` loads
another build (the sanitizer build, a test's).  A library that is there but does not match
these bindings -- built from older sources (its ``sp_abi_version()`` is not ``ABI_VERSION``, or a
function is missing) or with other block layouts than kernels/ggml_types.py's -- is refused
with one warning naming the rebuild command, and SpecPipe runs on the portable torch path.  ``SPECPIPE_NATIVE_ISA=portable|avx2|
avx512vnni|amx|neon`` forces a path (amx: AVX-512 VNNI with Intel AMX tile multiplies for
Q4_K's larger calls; it needs Linux to grant the tile state) (it must be supported by this CPU); it is read once per process,
so that every call of a process takes the same path (``reload_isa_code()`` re-reads it).
Results and design: docs/native_kernels.md.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path

import gguf
import torch

from specpipe.kernels import ggml_types

_HERE = Path(__file__).resolve().parent
LIBRARY = _HERE / "libspecpipe_native.so"
# ggml_matmul.h SP_ABI_VERSION: the interface these bindings (and layer.py's) are written for
ABI_VERSION = 4
REBUILD = "python3 -m specpipe.kernels.native.build (or ./install.sh)"

_ISA_CODES = {"portable": 0, "avx2": 1, "avx512vnni": 2, "neon": 3, "amx": 4}
_ISA_NAMES = {v: k for k, v in _ISA_CODES.items()}

_Q = gguf.GGMLQuantizationType
_SUPPORTED = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
                        *ggml_types.LOWBIT_TYPES})

_ERRORS = {1: "unsupported type", 2: "bad shape", 3: "ISA not supported by this CPU",
           4: "out of memory"}
# (block values, block bytes) by type id: looked up on every call, kept off the enum machinery
_BLOCKS = {int(t): ggml_types.BLOCKS[t] for t in _SUPPORTED}

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# Every function the bindings call, with its C signature (layer.py's two take its structs and
# are bound there): a library lacking one is refused at load, never half-used.
_SIGNATURES = {
    "sp_abi_version": ([], _i32),
    "sp_matmul": ([_i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i32, _i32], _i32),
    "sp_attention": ([_ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _i64, _ptr, ctypes.c_float, _ptr, _i32, _i32],
                     _i32),
    "sp_attention_sinks": ([_ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _i64, _ptr, ctypes.c_float, _ptr, _ptr, _i32,
                            _i32], _i32),
    "sp_rmsnorm": ([_ptr, _i64, _i64, _ptr, ctypes.c_float, _ptr], _i32),
    "sp_rope": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr], _i32),
    "sp_isa_supported": ([_i32], _i32),
    "sp_type_supported": ([_i32], _i32),
    "sp_best_isa": ([], _i32),
    "sp_has_openmp": ([], _i32),
    "sp_set_parallel_min_bytes": ([_i64], None),
    "sp_block_layout": ([_i32, ctypes.c_char_p, _i64], _i32),
    "sp_decoder_layer": (None, None),
    "sp_silu_mul": (None, None),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_best_isa = 0
_supported_isa_codes: frozenset[int] = frozenset()
_process_isa: int | None = None  # the path of this process: SPECPIPE_NATIVE_ISA or the best


def library_path() -> Path:
    """The library this process loads: SPECPIPE_NATIVE_LIBRARY, or the one built beside this file."""
    env = os.environ.get("SPECPIPE_NATIVE_LIBRARY", "").strip()
    return Path(env) if env else LIBRARY


def open_library(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """Load and check the library at `path`: (the bound library, None), or (None, why not).
    Checked: every function in _SIGNATURES is there, its ABI version is ABI_VERSION, and its
    block structs (sp_block_layout) are kernels/ggml_types.py's LAYOUTS, field by field."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
    if missing:
        return None, f"{path} lacks {', '.join(missing)}: built from older sources"
    for name, (args, res) in _SIGNATURES.items():
        if args is not None:
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    version = lib.sp_abi_version()
    if version != ABI_VERSION:
        return None, f"{path} has ABI version {version}, these bindings {ABI_VERSION}"
    buf = ctypes.create_string_buffer(512)
    for t in sorted(_SUPPORTED):
        want = ggml_types.layout_text(t)
        got = buf.value.decode() if lib.sp_block_layout(int(t), buf, len(buf)) == 0 else "(none)"
        if got != want:
            return None, f"{path}: {t.name} blocks are {got!r} in C, {want!r} in ggml_types.py"
    return lib, None


def _load() -> ctypes.CDLL | None:
    global _lib, _load_error, _best_isa, _supported_isa_codes, _refused
    if _lib is not None:  # the per-call path: no lock
        return _lib
    with _lock:
        if _lib is None and _load_error is None:
            path = library_path()
            if not path.exists():
                _load_error = f"{path} is not built"
            else:
                lib, why = open_library(path)
                if lib is None:
                    _load_error, _refused = f"{why}; rebuild it", True
                else:
                    _best_isa = lib.sp_best_isa()
                    _supported_isa_codes = frozenset(c for c in _ISA_CODES.values() if lib.sp_isa_supported(c))
                    _lib = lib
    if _refused and not _reported:  # a library that is there but refused: every process that looks says so
        _report(None)
    return _lib


_refused = False  # the library is there but does not match these bindings
_reported = False  # this process has said why the library is not used


def _message() -> str:
    return (f"specpipe's native CPU kernels are not in use ({_load_error}): GGUF weights stay packed in "
            f"memory but every matmul dequantizes them with torch (the portable kernel): on SmolLM2 Q4_1 "
            f"about 10-15x slower than the native kernel and 2-3x slower than float32 weights, which "
            f"SPECPIPE_KERNEL=float32 loads at 5.5x the memory (docs/quantized_weights.md). To build it: "
            f"reinstall with a C compiler (gcc or clang) present (pip install), or run {REBUILD}. "
            f"`specpipe env` shows what is in use.")


def unavailable_message() -> str | None:
    """What a user reads when the library cannot be used: why, what it costs, what to do (None
    when it is used)."""
    return None if _load() is not None else _message()


def _report(emit) -> str | None:
    global _reported
    with _lock:
        if _reported or _lib is not None or _load_error is None:
            return None
        _reported = True
    message = _message()
    if emit is None:
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    else:
        emit(message)
    return message


def report_unavailable(emit=None) -> str | None:
    """Once per process: when the library cannot be used, hand unavailable_message() to `emit`
    (default: a RuntimeWarning) and return it; None when it is used or was already reported.
    The CLI, the server and LLM(...) call it at start; a refused (stale) library reports itself
    whoever loads it."""
    _load()
    return _report(emit)


def describe() -> dict:
    """The library as this process sees it (specpipe env, /health): its path, whether it is
    built and loads (ABI and block layouts checked), why not, the ISA path and OpenMP."""
    lib = _load()
    path = library_path()
    return {"path": str(path), "built": path.exists(), "loaded": lib is not None, "problem": _load_error,
            "isa": isa() if lib is not None else None,
            "isas_supported": supported_isas() if lib is not None else [],
            "openmp": bool(lib.sp_has_openmp()) if lib is not None else None,
            "abi_version": ABI_VERSION}


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


def set_parallel_min_bytes(nbytes: int) -> None:
    """Matmul calls of fewer weight bytes x activation rows than `nbytes` run on one thread (the
    library's default: 2 MiB); 0 lets every call use the threads it is given."""
    _require().sp_set_parallel_min_bytes(int(nbytes))


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
# ggml_matmul.h SP_MAX_GROUP: the most query heads per KV head the attention takes
MAX_GROUP = 64


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float, threads: int | None = None, *, isa: str | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (T, Hq, D) over k, v (C, Hkv, D), mask (T, C) bool or None -> (T, Hq, D),
    all float32 CPU tensors. Each row's result depends only on the slots its mask lets it see,
    in their order: not on C, on the masked slots, on the other rows or on ``threads``.
    sinks: (Hq,) a logit per query head in each softmax's denominator (gpt-oss), or None."""
    lib = _lib if _lib is not None else _require()
    if not all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_cpu and x.dim() == 3
               for x in (q, k, v)):
        raise TypeError("native attention takes 3-D float32 CPU tensors q (T, Hq, D), k and v (C, Hkv, D)")
    t, hq, d = q.shape
    c, hkv, _ = k.shape
    if k.shape != v.shape or k.shape[2] != d or min(hq, hkv, d, c) < 1 or hq % hkv:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hq // hkv > MAX_GROUP:
        raise ValueError(f"{hq // hkv} query heads per KV head; the native attention takes at most {MAX_GROUP}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    m = None if mask is None else mask_bytes(mask, (t, c), "mask")
    out = torch.empty_like(q)
    if threads is None:
        threads = torch.get_num_threads() if t * hq * c * d >= _ATTENTION_THREADED_WORK else 1
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        if not sinks.is_cpu or tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must be ({hq},) on the CPU, got {tuple(sinks.shape)} on {sinks.device}")
        rc = lib.sp_attention_sinks(q.data_ptr(), t, hq, hkv, d, k.data_ptr(), v.data_ptr(), c,
                                    None if m is None else m.data_ptr(), float(scale), sinks.data_ptr(),
                                    out.data_ptr(), max(1, int(threads)), _isa_code(isa))
    else:
        rc = lib.sp_attention(q.data_ptr(), t, hq, hkv, d, k.data_ptr(), v.data_ptr(), c,
                              None if m is None else m.data_ptr(), float(scale), out.data_ptr(),
                              max(1, int(threads)), _isa_code(isa))
    if rc != 0:
        raise RuntimeError(f"sp_attention failed: {_ERRORS.get(rc, rc)}")
    return out


def mask_bytes(mask: torch.Tensor, shape: tuple[int, int], what: str) -> torch.Tensor:
    """A (rows, C) bool (or uint8, nonzero = may attend) CPU mask as the contiguous bytes C reads:
    the dtype, shape and device checked here, at the boundary (C reads rows * C bytes, as bytes:
    a short mask would be read past its end, an int64 or float one misread)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.bool, torch.uint8) or not mask.is_cpu:
        raise TypeError(f"{what} must be a bool (or uint8) CPU tensor, got {getattr(mask, 'dtype', type(mask))}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{what} must be {tuple(shape)}, got {tuple(mask.shape)}")
    return mask.contiguous().view(torch.uint8)


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


__all__ = ["available", "unavailable_reason", "unavailable_message", "report_unavailable", "describe", "library_path", "open_library", "ABI_VERSION", "MAX_GROUP", "supported_types", "supported_isas", "isa",
           "reload_isa_code",
           "matmul", "matmul_checked_packed", "attention", "rmsnorm", "rope", "has_openmp", "LIBRARY"]
