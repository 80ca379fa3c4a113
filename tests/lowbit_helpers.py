"""Random valid blocks of the low-bit GGUF types, for the kernel and loader tests (gguf-py cannot
quantize most of them: every byte pattern is a valid block once its scale fields are finite)."""

from __future__ import annotations

import gguf
import numpy as np

from specpipe.kernels.ggml_types import LAYOUTS

Q = gguf.GGMLQuantizationType


def random_blocks(qtype: Q, nblocks: int, rng: np.random.Generator, scale: float = 0.02,
                  extreme: bool = False) -> np.ndarray:
    """(nblocks, block bytes) random valid blocks: the f16 scales finite (|d| <= scale, or at
    the extremes: the largest finite half, the smallest subnormal, zero, negative), MXFP4's
    exponent near 2^-7 (or across its whole range)."""
    lay = LAYOUTS[qtype]
    raw = rng.integers(0, 256, (nblocks, lay.size), dtype=np.uint8)
    halves = [lay.fields[f][0] for f in ("d", "dmin") if f in lay.fields]
    for off in halves:
        if extreme:
            d = rng.choice(np.array([65504.0, -65504.0, 6e-8, -6e-8, 0.0, 1.0], np.float16), (nblocks, 1))
        else:
            d = rng.uniform(-scale, scale, (nblocks, 1)).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8)
    if qtype == Q.IQ1_M:  # d is the top nibbles of the four scale words: bits 12-15 = byte 55's high nibble
        raw[:, 55] &= 0x3F if not extreme else 0xBF  # exponent below 2^0 (|d| < 2; extreme: up to 65504 is off)
        if not extreme:
            raw[:, 55] |= 0x20  # 2^-7 <= |d| (positive), a sane scale
    if qtype == Q.MXFP4:
        raw[:, 0] = rng.integers(0, 256, nblocks) if extreme else rng.integers(115, 125, nblocks)
    return raw
