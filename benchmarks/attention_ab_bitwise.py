#!/usr/bin/env python3
"""The native attention of this checkout against another build of the library, bitwise, on
random cases: shapes, masks (none, random, sparse, a tree layer's), every ISA path, 1-3 threads.
For a change to attention.c that must keep every sum's order: build the old library first
(git stash; python -m specpipe.kernels.native.build; cp the .so to OLD.so; git stash pop; build).
Exits 1 if any case differs.

    PYTHONPATH=. python benchmarks/attention_ab_bitwise.py OLD.so [CASES]
"""

from __future__ import annotations

import ctypes
import random
import sys

import torch

from specpipe.kernels import native


def random_mask(kind: str, t: int, c: int, g: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "tree" and c >= t:  # the prefix whole, then each row's ancestors and itself
        p = c - t
        mask = torch.zeros(t, c, dtype=torch.bool)
        mask[:, :p] = True
        for i in range(t):
            mask[i, p + i] = True
            mask[i, p:p + i] = torch.rand(i, generator=g) < 0.5
    else:
        mask = torch.rand(t, c, generator=g) < (0.1 if kind == "sparse" else 0.7)
    mask[:, 0] = True
    return mask


def main() -> int:
    old = ctypes.CDLL(sys.argv[1])
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    old.sp_attention.argtypes = [ptr, i64, i32, i32, i32, ptr, ptr, i64, ptr, ctypes.c_float, ptr, i32, i32]
    cases = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    rng = random.Random(1)
    bad = 0
    for case in range(cases):
        hkv, group = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 6, 7, 9])
        hq, d = hkv * group, rng.choice([8, 16, 24, 64, 72, 128])
        c, t = rng.choice([1, 3, 8, 9, 31, 32, 33, 70, 200, 513]), rng.choice([1, 2, 3, 7, 8, 9, 17, 33])
        g = torch.Generator().manual_seed(case)
        q, k, v = torch.randn(t, hq, d, generator=g), torch.randn(c, hkv, d, generator=g), torch.randn(c, hkv, d, generator=g)
        kind = rng.choice(["none", "random", "tree", "sparse"])
        mask = random_mask(kind, t, c, g)
        isa, threads = rng.choice(["portable", "avx2", "avx512vnni"]), rng.choice([1, 2, 3])
        new = native.attention(q, k, v, mask, 0.09, threads, isa=isa)
        ref = torch.empty_like(q)
        m = None if mask is None else mask.contiguous().view(torch.uint8).data_ptr()
        rc = old.sp_attention(q.data_ptr(), t, hq, hkv, d, k.data_ptr(), v.data_ptr(), c, m, 0.09,
                              ref.data_ptr(), threads, native._resolve(isa))
        if rc != 0:
            raise RuntimeError(f"the old library failed: {rc}")
        if not torch.equal(new, ref):
            bad += 1
            print("different:", dict(t=t, hq=hq, hkv=hkv, d=d, c=c, mask=kind, isa=isa, threads=threads))
    print(f"{cases} cases, {bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
