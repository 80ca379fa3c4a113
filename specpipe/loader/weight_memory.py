"""Memory for a model's weights, on transparent huge pages where the kernel offers them.

A one-row decode step streams every weight of its layers once, so its speed is the memory's read
pace (docs/benchmarks.md §9). With 4 KiB pages a stream of gigabytes misses the TLB every 4 KiB; a
2 MiB page covers 512 of them. Linux hands huge pages to anonymous memory by itself only where
/sys/kernel/mm/transparent_hugepage/enabled says `always`; the usual default, `madvise`, gives them
to a mapping that asks. A `bytearray` never asks (and torch's allocator asks only under
THP_MEM_ALLOC_ENABLE=1), so the loader reads tensors into buffers from here, which ask.

Where the platform has no MADV_HUGEPAGE (not Linux), the buffer is an ordinary bytearray; where the
kernel's mode is `never`, the request is ignored and the pages are ordinary ones. Either way the
bytes are the same. SPECPIPE_HUGE_PAGES=0 turns the request off (for comparisons).
"""

from __future__ import annotations

import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels' PMD page


def on_huge_pages(nbytes: int) -> bool:
    """Whether a weight buffer of `nbytes` asks for huge pages: at least one huge page long (a smaller
    one would waste the rest of its page), on a platform that can ask, unless SPECPIPE_HUGE_PAGES=0."""
    return (nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("SPECPIPE_HUGE_PAGES", "1").strip().lower() not in ("0", "false", "no", "off"))


def weight_buffer(nbytes: int):
    """A writable buffer of `nbytes` zero bytes that this process owns: an anonymous mapping advised
    for huge pages where on_huge_pages says so, else a bytearray. The mapping is freed when the
    last view of it goes."""
    if not on_huge_pages(nbytes):
        return bytearray(nbytes)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP: ordinary pages
        pass
    return buf


def weight_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialised bytes (uint8) in weight memory that start on a huge-page boundary, so
    that every whole huge page inside them can be one (an unaligned mapping loses its first and
    last partial ones)."""
    if not on_huge_pages(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(weight_buffer(nbytes + HUGE_PAGE), dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def weight_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in weight memory (see weight_buffer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not on_huge_pages(nbytes):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(weight_buffer(nbytes), dtype=dtype).view(shape)
