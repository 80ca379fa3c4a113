"""Measure the cost profile the time simulator needs (specpipe/sim/timing.py), on this device:
milliseconds of one target decoder layer, of the target's norm + LM head, and of one whole draft
forward, for n rows at a fixed context length.

  python benchmarks/profile_costs.py --pair qwen --out profile.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from specpipe.config import StageSpec  # noqa: E402
from specpipe.engine.default_model import default_model_path  # noqa: E402
from specpipe.loader import open_checkpoint  # noqa: E402
from specpipe.model.runner import run_rows  # noqa: E402
from specpipe.model.stage import build_stage  # noqa: E402
from specpipe.sim.timing import CostProfile  # noqa: E402

ROWS = [1, 2, 4, 8, 16, 32, 64]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def forward_ms(model, n: int, context: int, hidden: bool, repeats: int) -> float:
    """One forward of n new rows after `context` cached tokens (all visible, like a tree layer)."""
    kv = model.make_kv_cache(context + n)
    cfg = model.cfg
    data = torch.randn(n, cfg.hidden_size) if hidden else torch.randint(0, cfg.vocab_size, (n,))
    positions = [context] * n
    write = list(range(context, context + n))
    read = list(range(context + n))
    import numpy as np

    mask = np.zeros((n, context + n), dtype=bool)
    mask[:, :context] = True
    mask[np.arange(n), context + np.arange(n)] = True  # each node sees the prefix and itself
    return timed(lambda: run_rows(model, kv, data, positions, write, read, mask), repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", choices=["qwen", "smollm2"], default="qwen")
    ap.add_argument("--draft", default=None, help="draft model path (default: the pair's); 'none' for none")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.pair == "qwen":
        from model_pair import ensure_model_pair

        target, draft = ensure_model_pair()
    else:
        target, draft = default_model_path(), None
    if args.draft:
        draft = None if args.draft == "none" else args.draft
    ckpt = open_checkpoint(target)
    L = ckpt.config.num_layers
    # Two middle layers without embedding or head: the per-layer cost.
    mid = build_stage(ckpt, StageSpec(L // 2, L // 2 + 2, first=False, last=False))
    last = build_stage(ckpt, StageSpec(L - 1, L, first=False, last=True))
    layer_ms, head_ms, draft_ms = [], [], []
    for n in ROWS:
        layer = forward_ms(mid, n, args.context, True, args.repeats) / 2
        with_head = forward_ms(last, n, args.context, True, args.repeats)
        layer_ms.append(layer)
        head_ms.append(max(0.0, with_head - layer))
        print(f"target n={n:3d}: layer {layer:7.2f} ms, head {head_ms[-1]:7.2f} ms, "
              f"whole model ~{L * layer + head_ms[-1]:7.1f} ms", file=sys.stderr)
    if draft:
        dckpt = open_checkpoint(draft)
        dmodel = build_stage(dckpt, StageSpec.whole(dckpt.config))
        for n in ROWS:
            draft_ms.append(forward_ms(dmodel, n, args.context, False, args.repeats))
            print(f"draft  n={n:3d}: {draft_ms[-1]:7.1f} ms", file=sys.stderr)
    device = f"{platform.processor() or platform.machine()} CPU, {args.threads} threads, torch {torch.__version__}"
    profile = CostProfile(device, ROWS, layer_ms, head_ms, draft_ms, args.context)
    Path(args.out).write_text(json.dumps({"target": str(target), "draft": str(draft), "num_layers": L,
                                          "profile": asdict(profile)}))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
