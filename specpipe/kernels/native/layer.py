"""Bindings of layer.c: a whole decoder layer in one native call, and silu(gate) * up.

`LayerWeights` is built once per layer (model/fused.py decides which layers qualify) and holds
the C descriptor with pointers into the layer's own tensors, which it keeps alive. `Segments`
is built once per forward call (the same for every layer of a stage) from the attention
metadata. `decoder_layer` then runs norm, projections, rotary embeddings, the KV cache writes,
attention, the MLP and both residual adds in C, with the same bits as model/llama.py's layer
written out in torch over the same native parts.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specpipe.kernels import native

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class _Proj(ctypes.Structure):
    _fields_ = [("type", _i32), ("w", _ptr), ("n", _i64), ("row_bytes", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("inter", _i64), ("hq", _i32), ("hkv", _i32), ("d", _i32),
                ("n_qkv", _i32), ("n_gu", _i32), ("eps", _f32), ("scale", _f32),
                ("in_norm", _ptr), ("post_norm", _ptr), ("qkv", _Proj * 3), ("gu", _Proj * 2),
                ("o", _Proj), ("down", _Proj)]


class _Segment(ctypes.Structure):
    _fields_ = [("start", _i64), ("end", _i64), ("c", _i64), ("slots", _ptr), ("first", _i64),
                ("mask", _ptr)]


_bound = False


def available() -> bool:
    """The library is built and loads (native.open_library checks that it has layer.c's entry
    points and this ABI version; a stale one is refused there, with its warning)."""
    return native.available()


def _lib() -> ctypes.CDLL:
    global _bound
    lib = native._lib if native._lib is not None else native._require()
    if not _bound:
        lib.sp_decoder_layer.argtypes = [ctypes.POINTER(_Layer), _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr,
                                         _i64, _ptr, _i32, ctypes.POINTER(_Segment), _ptr, _i32, _i32]
        lib.sp_decoder_layer.restype = _i32
        lib.sp_silu_mul.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i32]
        lib.sp_silu_mul.restype = _i32
        _bound = True
    return lib


@dataclass(frozen=True)
class Projection:
    """One packed projection as the native kernel holds it (QuantLinear.prepared) and its bias."""

    packed: torch.Tensor  # (n, row_bytes) uint8
    type_id: int
    bias: Optional[torch.Tensor]  # (n,) float32


class LayerWeights:
    """The C descriptor of one layer. qkv: 1-3 projections whose outputs, side by side, are
    q (hq * d), k and v (hkv * d each); gate_up: 1-2 giving gate and up (inter each)."""

    def __init__(self, *, hidden: int, inter: int, hq: int, hkv: int, d: int, eps: float,
                 scale: Optional[float], in_norm: torch.Tensor, post_norm: torch.Tensor,
                 qkv: Sequence[Projection], o: Projection, gate_up: Sequence[Projection],
                 down: Projection) -> None:
        if not (1 <= len(qkv) <= 3 and 1 <= len(gate_up) <= 2):
            raise ValueError(f"a layer takes 1-3 q/k/v and 1-2 gate/up projections, got {len(qkv)}, {len(gate_up)}")
        if min(hidden, inter, hq, hkv, d) < 1 or hq % hkv or hq // hkv > native.MAX_GROUP:
            raise ValueError(f"a layer of hidden {hidden}, inter {inter}, {hq} query / {hkv} KV heads of {d} "
                             f"(at most {native.MAX_GROUP} query heads per KV head)")
        # every projection's (inputs, outputs): checked here with a message, and again in C
        # (layer.c group_ok) before the call writes anything
        for name, group, k, n in (("q/k/v", qkv, hidden, (hq + 2 * hkv) * d), ("o", (o,), hq * d, hidden),
                                  ("gate/up", gate_up, hidden, 2 * inter), ("down", (down,), inter, hidden)):
            _check_group(name, group, k, n)
        for t in (in_norm, post_norm):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != (hidden,):
                raise ValueError(f"norm weights must be contiguous float32 ({hidden},)")
        self._keep = [in_norm, post_norm, *(t for p in (*qkv, o, *gate_up, down) for t in (p.packed, p.bias)
                                            if t is not None)]
        c = _Layer(hidden=hidden, inter=inter, hq=hq, hkv=hkv, d=d, n_qkv=len(qkv), n_gu=len(gate_up),
                   eps=eps, scale=1.0 / math.sqrt(d) if scale is None else scale,
                   in_norm=in_norm.data_ptr(), post_norm=post_norm.data_ptr())
        for i, p in enumerate(qkv):
            c.qkv[i] = _proj(p)
        for i, p in enumerate(gate_up):
            c.gu[i] = _proj(p)
        c.o, c.down = _proj(o), _proj(down)
        self.c, self.hidden, self.hkv, self.d = c, hidden, hkv, d


def _check_group(name: str, group: Sequence[Projection], k: int, n: int) -> None:
    """Projections of k inputs whose outputs, side by side, are n wide (a known type, rows of
    k values)."""
    rows = 0
    for p in group:
        if p.packed.dtype != torch.uint8 or p.packed.dim() != 2 or not p.packed.is_contiguous():
            raise ValueError(f"the {name} projection's packed rows must be a contiguous 2-D uint8 tensor")
        if int(p.type_id) not in native._BLOCKS:
            raise ValueError(f"the {name} projection's GGML type {p.type_id} is not one the native kernel reads")
        values, size = native._BLOCKS[int(p.type_id)]
        if k % values or p.packed.shape[1] != k // values * size:
            raise ValueError(f"the {name} projection's rows are {p.packed.shape[1]} bytes; {k} inputs of "
                             f"{native._name(p.type_id)} need {k // values * size} (and a multiple of {values})")
        rows += p.packed.shape[0]
    if rows != n:
        raise ValueError(f"the {name} projections give {rows} outputs; the layer's shape needs {n}")


def _proj(p: Projection) -> _Proj:
    """The C view of a projection whose packed rows _check_group has accepted."""
    n, row_bytes = p.packed.shape
    if p.bias is not None and (p.bias.dtype != torch.float32 or p.bias.shape != (n,) or not p.bias.is_contiguous()):
        raise ValueError(f"a projection's bias must be contiguous float32 ({n},)")
    return _Proj(type=p.type_id, w=p.packed.data_ptr(), n=n, row_bytes=row_bytes,
                 bias=None if p.bias is None else p.bias.data_ptr())


class Segments:
    """The C view of an AttentionMetadata's segments (row ranges, read slots, masks)."""

    def __init__(self, segments) -> None:
        self._keep = []
        self.c = (_Segment * len(segments))()
        for i, seg in enumerate(segments):
            start, end = int(seg.start), int(seg.end)
            slots = seg.read_slots
            # what C cannot see is checked here, per segment (O(1) each; the slots' values are
            # checked against the cache in C, before anything is written)
            if not 0 <= start <= end:
                raise ValueError(f"segment {i}: rows [{start}, {end})")
            if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1 \
                    or not slots.is_cpu or slots.numel() < 1:
                raise TypeError(f"segment {i}: read_slots must be a non-empty 1-D int64 CPU tensor, got "
                                f"{getattr(slots, 'dtype', type(slots))} {tuple(getattr(slots, 'shape', ()))}")
            slots = slots.contiguous()
            c = slots.numel()
            ranged = seg.read_range is not None
            if ranged and int(seg.read_range[1]) - int(seg.read_range[0]) != c:
                raise ValueError(f"segment {i}: read_range {tuple(seg.read_range)} is not its {c} read slots")
            mask = None
            if seg.mask is not None:
                mask = native.mask_bytes(seg.mask, (end - start, c), f"segment {i}'s mask")
                self._keep.append(mask)
            self._keep.append(slots)
            self.c[i] = _Segment(start=start, end=end, c=c,
                                 slots=None if ranged else slots.data_ptr(),
                                 first=int(seg.read_range[0]) if ranged else 0,
                                 mask=None if mask is None else mask.data_ptr())
        self.count = len(segments)


def decoder_layer(w: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, write_slots: torch.Tensor,
                  segments: Segments, threads: int) -> torch.Tensor:
    """x (T, hidden) -> the layer's output (T, hidden); the rows' K/V are written into the
    layer's caches (num_slots, hkv, d) at write_slots (T,) first. cos, sin: (T, 1, rot)."""
    t = x.shape[0]
    rot = cos.shape[-1]
    for name, a, dtype in (("x", x, torch.float32), ("cos", cos, torch.float32), ("sin", sin, torch.float32),
                           ("k_cache", k_cache, torch.float32), ("v_cache", v_cache, torch.float32),
                           ("write_slots", write_slots, torch.int64)):
        if a.dtype != dtype or not a.is_contiguous() or not a.is_cpu:
            raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")
    if x.shape != (t, w.hidden) or cos.numel() != t * rot or sin.numel() != t * rot or write_slots.numel() != t:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, cos {tuple(cos.shape)}, "
                         f"write_slots {tuple(write_slots.shape)}")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[1:]) != (w.hkv, w.d):
        raise ValueError(f"the caches must be (slots, {w.hkv}, {w.d}), got {tuple(k_cache.shape)}")
    out = torch.empty_like(x)
    rc = _lib().sp_decoder_layer(ctypes.byref(w.c), x.data_ptr(), t, cos.data_ptr(), sin.data_ptr(), rot,
                                 k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                                 write_slots.data_ptr(), segments.count, segments.c, out.data_ptr(),
                                 max(1, int(threads)), native._isa_code(None))
    if rc != 0:
        raise RuntimeError(f"sp_decoder_layer failed: {native._ERRORS.get(rc, rc)} (x {tuple(x.shape)}, "
                           f"{k_cache.shape[0]} cache slots; a slot out of range or rows not covered by the segments?)")
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """silu(gate) * up for (T, n) float32 CPU tensors whose rows are contiguous (views of a
    stacked gate|up output are fine): layer.c's element-wise arithmetic, so the torch-written
    MLP and the fused layer agree bitwise (every ISA path gives the same bits; ``isa`` forces
    one, as in ``native.matmul``)."""
    t, n = gate.shape
    if up.shape != gate.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty((t, n), dtype=torch.float32)
    rc = _lib().sp_silu_mul(gate.data_ptr(), up.data_ptr(), t, n, gate.stride(0), up.stride(0), y.data_ptr(),
                            native._isa_code(isa))
    if rc != 0:
        raise RuntimeError(f"sp_silu_mul failed: {native._ERRORS.get(rc, rc)}")
    return y
