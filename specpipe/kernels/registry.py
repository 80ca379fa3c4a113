"""The small interface a matmul kernel implements, and the choice of one per weight type and device.

A kernel turns a weight's packed GGML rows into the layout it reads (`prepare`, once, at load;
it may repack but must not keep the packed form beside the repacked one) and multiplies float32
activations by it (`matmul`). Every kernel must be batch-invariant: a row's output may not
depend on the rows that share its call (tests/kernels/test_batch_invariance.py checks each).

Kernels, in order of preference (benchmarks/bench_native_kernel.py --registry measured the order, see
docs/quantized_weights.md):
  native    the C kernel in specpipe/kernels/native (when built): exact float32 activations
  dequant   the portable kernel: a tile of weight rows dequantized per call (the reference's
            values) into a reused buffer, then the float matmul with a fixed row tile: any
            type, float32 activations, memory the file's size; 2-3x slower than float32
            weights, 10-15x the native kernel (docs/quantized_weights.md)
  int4pack  torch's int4 CPU matmul for Q4_0 / Q4_1 / Q4_K (repacked once; bf16 activations,
            scales and outputs): fast but not the file's weights to float32 precision, so it is
            used only when asked for (`prefer`)
"""

from __future__ import annotations

from typing import Any, Protocol

import gguf
import torch

Q = gguf.GGMLQuantizationType


class Kernel(Protocol):
    name: str

    def supports(self, qtype: Q, device: torch.device | str) -> bool: ...

    def prepare(self, packed: torch.Tensor, qtype: Q, out_features: int, in_features: int) -> Any: ...

    def matmul(self, x: torch.Tensor, prepared: Any) -> torch.Tensor: ...


def _kernels() -> list[Kernel]:
    from specpipe.kernels import torch_kernels

    found: list[Kernel] = []
    try:  # written separately; absent or unbuilt means the torch kernels carry on alone
        from specpipe.kernels import native
        if native.available():
            found.append(torch_kernels.NativeKernel(native))
    except ImportError:
        pass
    return found + [torch_kernels.DequantKernel(), torch_kernels.Int4PackKernel()]


_REGISTRY: list[Kernel] = []


def kernels() -> list[Kernel]:
    """Every kernel this process can use, most preferred first."""
    if not _REGISTRY:
        _REGISTRY.extend(_kernels())
    return _REGISTRY


def get_kernel(name: str) -> Kernel:
    for k in kernels():
        if k.name == name:
            return k
    raise KeyError(f"no kernel {name!r} (have: {', '.join(k.name for k in kernels())})")


def choose_kernel(qtype: Q, device: torch.device | str, prefer: str | None = None) -> Kernel:
    """The most preferred kernel that supports `qtype` on `device` (`prefer`, a kernel name,
    goes first when it supports the type)."""
    order = sorted(kernels(), key=lambda k: k.name != prefer)  # stable: the rest keep their order
    for k in order:
        if k.supports(qtype, device):
            return k
    raise ValueError(f"no kernel multiplies {qtype.name} weights on {device}")
