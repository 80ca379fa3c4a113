"""Linear layers whose weights stay in a GGML type: QuantLinear (projections, LM head),
QuantEmbedding (token embedding, decoding only the rows it looks up) and StackedLinear (several
projections of one input as one matmul).

The weight lives as the kernel prepared it (`prepared`, a buffer-like object, not a float
parameter), so a stage's memory is about the checkpoint's share. A tied LM head is a QuantLinear
built on the embedding's packed tensor (`QuantLinear.tied_to`): the bytes are held once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import gguf
import torch
import torch.nn as nn

from specpipe.kernels.ggml_types import dequantize, row_bytes
from specpipe.kernels.registry import Kernel, choose_kernel, get_kernel
from specpipe.kernels.torch_kernels import invariant_linear

Q = gguf.GGMLQuantizationType


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors inside a kernel's prepared layout (a tensor, tuple or dataclass)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


class FloatLinear(nn.Linear):
    """nn.Linear with float weights, batch-invariant (torch_kernels.invariant_linear). Weights
    stored in another float type than the activations (bf16 from a checkpoint, float32
    activations on a CPU) are converted per call, so memory holds them as stored."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if w.dtype != x.dtype:
            w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
        return invariant_linear(x, w, b)


def select_outputs(linear: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A linear layer computing only the outputs `ids` of `linear` (its weight rows `ids`): a
    draft's LM head over part of the vocabulary. With the native kernel each output keeps its bits
    (an element depends on its own weight row alone)."""
    ids = ids.to(torch.long)
    if isinstance(linear, QuantLinear):
        if linear.packed is None:
            raise ValueError(f"the {linear.kernel} kernel repacks its weights: their rows cannot be selected")
        bias = None if linear.bias is None else linear.bias[ids.to(linear.bias.device)]
        return QuantLinear(linear.packed.index_select(0, ids.to(linear.packed.device)), linear.qtype,
                           linear.in_features, len(ids), bias, linear._kernel)
    w = linear.weight.detach()
    out = FloatLinear(linear.in_features, len(ids), bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(w.index_select(0, ids.to(w.device)), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach()[ids.to(w.device)], requires_grad=False)
    return out


class QuantLinear(nn.Module):
    """y = x W^T + b with W (out, in) held as packed GGML rows; x (T, in) -> (T, out), computed in
    float32 and returned in x's dtype."""

    def __init__(self, packed: torch.Tensor, qtype: Q, in_features: int, out_features: int,
                 bias: Optional[torch.Tensor] = None, kernel: Optional[Kernel] = None) -> None:
        super().__init__()
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (out_features, row_bytes(qtype, in_features)):
            raise ValueError(f"packed {qtype.name} weight should be ({out_features}, "
                             f"{row_bytes(qtype, in_features)}) uint8, got {tuple(packed.shape)} {packed.dtype}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self._kernel = kernel or choose_kernel(qtype, packed.device)
        # A kernel that keeps the packed layout hands back `packed` itself (or a tuple holding
        # it); one that repacks builds its own and `packed` is dropped by the caller.
        try:
            self.prepared = self._kernel.prepare(packed, qtype, out_features, in_features)
        except ValueError:  # a shape this kernel cannot take (int4pack: out % 16): the reference can
            self._kernel = get_kernel("dequant")
            self.prepared = self._kernel.prepare(packed, qtype, out_features, in_features)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def packed(self) -> Optional[torch.Tensor]:
        """The packed GGML rows (out, row_bytes), when the kernel reads them as they are (native,
        dequant); None when it repacked them into its own layout at load (int4pack)."""
        p = self.prepared
        return p[0] if isinstance(p, tuple) and isinstance(p[0], torch.Tensor) else None

    @property
    def kernel(self) -> str:
        return self._kernel.name

    def use_packed(self, packed: torch.Tensor) -> None:
        """Read the weights from `packed` from now on: a copy of `packed`'s bytes elsewhere in
        memory (stage.py pack_weights), for a kernel that reads them as they are."""
        if self.packed is None or packed.shape != self.packed.shape:
            raise ValueError(f"the {self.kernel} kernel cannot take packed rows of shape {tuple(packed.shape)}")
        self.prepared = self._kernel.prepare(packed, self.qtype, self.out_features, self.in_features)

    def weight_tensors(self) -> list[torch.Tensor]:
        return _tensors(self.prepared)

    @property
    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._kernel.matmul(x.float(), self.prepared)  # (T, out), float32
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)  # the activations' dtype (bfloat16 activations: the KV cache's)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.qtype.name}, kernel={self.kernel}"


class QuantEmbedding(nn.Module):
    """Token embedding (vocab, hidden) as packed rows: a lookup dequantizes only its rows."""

    def __init__(self, packed: torch.Tensor, qtype: Q, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        if tuple(packed.shape) != (num_embeddings, row_bytes(qtype, embedding_dim)):
            raise ValueError(f"packed embedding has shape {tuple(packed.shape)}")
        self.qtype, self.num_embeddings, self.embedding_dim = qtype, num_embeddings, embedding_dim
        self.register_buffer("packed", packed)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.packed]

    @property
    def weight_nbytes(self) -> int:
        return self.packed.numel()

    def use_packed(self, packed: torch.Tensor) -> None:
        """Read the rows from `packed` from now on (a copy of them: stage.py pack_weights)."""
        if packed.shape != self.packed.shape:
            raise ValueError(f"packed embedding has shape {tuple(packed.shape)}, not {tuple(self.packed.shape)}")
        self.packed = packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.packed.index_select(0, ids), self.qtype)  # (T, hidden) float32

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name}"


class StackedLinear(nn.Module):
    """Several projections of the same input (q, k, v; gate, up) computed together: each run of
    consecutive parts that are QuantLinear of one GGML type on the native kernel becomes one
    QuantLinear over their stacked rows, so a step makes one kernel call (one pass over x, one
    thread team) instead of one per projection. The native kernel computes every output element
    from its own weight row and the input row alone, so stacking changes no bit of any output.
    Other parts stay as they are. forward returns one tensor per part, in order (views of the
    stacked output)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        groups: list[list[nn.Module]] = []
        for m in parts:
            if groups and _stackable(groups[-1][-1], m):
                groups[-1].append(m)
            else:
                groups.append([m])
        self.groups = nn.ModuleList(g[0] if len(g) == 1 else _stack(g) for g in groups)
        self.sizes = [[m.out_features for m in g] for g in groups]

    @property
    def num_calls(self) -> int:
        return len(self.groups)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for mod, sizes in zip(self.groups, self.sizes):
            y = mod(x)
            outs.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else (y,))
        return outs


def _stackable(a: nn.Module, b: nn.Module) -> bool:
    return (isinstance(a, QuantLinear) and isinstance(b, QuantLinear) and a.kernel == b.kernel == "native"
            and a.qtype == b.qtype and a.in_features == b.in_features
            and (a.bias is None) == (b.bias is None) and a.packed is not None and b.packed is not None)


def _stack(parts: list[QuantLinear]) -> QuantLinear:
    packed = torch.cat([m.packed for m in parts])  # on a CPU, build_stage then moves it to huge pages (pack_weights)
    bias = None if parts[0].bias is None else torch.cat([m.bias for m in parts])
    return QuantLinear(packed, parts[0].qtype, parts[0].in_features, sum(m.out_features for m in parts),
                       bias, parts[0]._kernel)
