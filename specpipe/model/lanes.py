"""Elementwise ops whose rows must not depend on how many rows share the call.

torch's vectorised elementwise kernels (silu, gelu, sigmoid) on this AVX-512 CPU give an element
other bits when it falls in a loop's remainder than in its main body, so with a row width that is
not a multiple of the vector (a 48-wide tiny expert, a router over 8 experts) a row's result
depended on how many rows shared the call -- and a tree row must equal the row pp computes alone
(the lossless property). Rows padded to a multiple of LANES columns put every element in the same
place of the loop whatever the row count. Real models' widths are multiples of 64: no copy there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LANES = 64


def pad_columns(x: torch.Tensor) -> torch.Tensor:
    """x (T, N) with zero columns appended up to a multiple of LANES (x itself when N is one);
    the caller keeps the first N columns of what it computes."""
    pad = -x.shape[-1] % LANES
    return F.pad(x, (0, pad)) if pad else x
