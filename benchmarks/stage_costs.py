"""Where a stage's step time goes, three diagnostics behind docs/benchmarks.md §4.4 and §9 (real
runs, one thread, one process):

  head     the LM head's cost as a profile takes it (a last stage of 1 layer minus a middle one),
           against the same on last stages of --sizes layers, and the whole model's stage
  idle     a stage's one-row step with the stage idling --gaps ms before every step (a run of
           --steps steps per gap, as a pipeline stage waits), sleeping and spinning
  matmuls  every quantized matmul of the model called alone in model order at one row (each reads
           its weights from memory), GB/s of the layers' and the head's, and one matmul called
           again at once (its weights still in the cache)
  attention  one query row's attention over --context cached slots per layer of the model's
           shape, after streaming 256 MB past the caches (as a decode step's layers do), the
           median over --steps passes of all layers, us a layer (compare builds with
           SPECPIPE_NATIVE_LIBRARY: `build --define SP_ATT_PREFETCH=0`)
  split    the whole model's one-row step against the same stage's matmuls alone (straight
           through the native sp_matmul, in the order the step reads them), alternately, --steps
           times: what the rest of the step (attention, norms, the Python around it) costs

  PYTHONPATH=. python benchmarks/stage_costs.py head --sizes 15,30
  PYTHONPATH=. python benchmarks/stage_costs.py idle --layers 15:30 --gaps 0,2,5,10,20
  PYTHONPATH=. python benchmarks/stage_costs.py matmuls --model TARGET
  PYTHONPATH=. python benchmarks/stage_costs.py split --model TARGET --context 128 --steps 21
  PYTHONPATH=. python benchmarks/stage_costs.py attention --model TARGET --context 128 --steps 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specpipe.config import StageSpec
from specpipe.costs.measure import StageTimer
from specpipe.kernels.qlinear import QuantLinear
from specpipe.loader import open_checkpoint
from specpipe.model.stage import build_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import resolve_model  # noqa: E402


def timer(ckpt, spec: StageSpec, context: int) -> StageTimer:
    return StageTimer(build_stage(ckpt, spec), [context], [1], torch.device("cpu"), torch.float32, lambda: None, 1)


def head(ckpt, args) -> None:
    L, ctx = ckpt.config.num_layers, args.context
    stages = {"middle 1": StageSpec(0, 1, False, False), "last 1": StageSpec(L - 1, L, False, True),
              "whole model": StageSpec.whole(ckpt.config)}
    for k in args.sizes:
        stages |= {f"middle {k}": StageSpec(0, k, False, False), f"last {k}": StageSpec(L - k, L, False, True)}
    timers = {name: timer(ckpt, spec, ctx) for name, spec in stages.items()}
    for r in range(args.rounds):
        ms = {name: t.ms(1, ctx, args.steps) for name, t in timers.items()}
        heads = {k: ms[f"last {k}"] - ms[f"middle {k}"] for k in [1, *args.sizes]}
        print(f"round {r + 1}: head on a last stage of " + ", ".join(f"{k} layers {v:.2f} ms" for k, v in heads.items())
              + f"; whole model {ms['whole model']:.2f} ms", flush=True)


def idle(ckpt, args) -> None:
    a, b = (int(x) for x in args.layers.split(":"))
    t = timer(ckpt, StageSpec(a, b, a == 0, b == ckpt.config.num_layers), args.context)

    def run(gap_ms: float, spin: bool) -> float:
        out = []
        for _ in range(args.steps + 3):
            end = time.perf_counter() + gap_ms / 1e3
            if spin:
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(gap_ms / 1e3)
            out.append(t.step_ms(1, args.context))
        return statistics.median(out[3:])

    for r in range(args.rounds):
        line = ", ".join(f"{g} ms {run(g, False):.2f}" for g in args.gaps)
        print(f"round {r + 1}: layers {a}-{b - 1}, one-row step after idling {line}; spinning "
              f"{args.gaps[-1]} ms {run(args.gaps[-1], True):.2f}", flush=True)


def matmuls(ckpt, args) -> None:
    model = build_stage(ckpt, StageSpec.whole(ckpt.config))
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    xs = {m.in_features: torch.randn(1, m.in_features) for _, m in mods}
    times: dict[str, list[float]] = {n: [] for n, _ in mods}
    for _ in range(args.rounds + 1):  # the first pass warms up
        for n, m in mods:
            t0 = time.perf_counter()
            m(xs[m.in_features])
            times[n].append(time.perf_counter() - t0)
    ms = {n: statistics.median(v[1:]) * 1e3 for n, v in times.items()}
    size = {n: m.weight_nbytes for n, m in mods}
    layers = [n for n in ms if n != "lm_head"]
    lay_ms, lay_b = sum(ms[n] for n in layers), sum(size[n] for n in layers)
    print(f"layers' matmuls {lay_ms:.1f} ms for {lay_b / 1e6:.0f} MB ({lay_b / lay_ms / 1e6:.2f} GB/s); "
          f"head {ms['lm_head']:.1f} ms for {size['lm_head'] / 1e6:.0f} MB ({size['lm_head'] / ms['lm_head'] / 1e6:.2f} GB/s)")
    n, m = max(((n, m) for n, m in mods if n != "lm_head"), key=lambda p: size[p[0]])
    m(xs[m.in_features])
    again = []
    for _ in range(15):
        t0 = time.perf_counter()
        m(xs[m.in_features])
        again.append(time.perf_counter() - t0)
    warm = statistics.median(again) * 1e3
    print(f"{n} ({size[n] / 1e6:.1f} MB): from memory {size[n] / ms[n] / 1e6:.2f} GB/s, "
          f"called again at once {size[n] / warm / 1e6:.2f} GB/s")


def split(ckpt, args) -> None:
    from specpipe.kernels import native

    t = timer(ckpt, StageSpec.whole(ckpt.config), args.context)
    lib = native._require()
    weights = sorted(((m.weight_tensors()[0], m) for m in t.model.modules() if isinstance(m, QuantLinear)),
                     key=lambda e: e[0].data_ptr())  # the read order (model/stage.py pack_weights)
    x, y = torch.randn(max(m.in_features for _, m in weights)), torch.empty(max(m.out_features for _, m in weights))
    calls = [(int(m.qtype), m.in_features, w.data_ptr(), m.out_features, w.shape[1]) for w, m in weights]

    def matmuls_ms() -> float:
        t0 = time.perf_counter()
        for qtype, k, w, n, row_bytes in calls:
            if lib.sp_matmul(qtype, x.data_ptr(), 1, k, w, n, row_bytes, y.data_ptr(), 1, native._isa_code(None)):
                raise RuntimeError("sp_matmul failed")
        return (time.perf_counter() - t0) * 1e3

    steps, alone = [], []
    for _ in range(args.steps):
        steps.append(t.step_ms(1, args.context))
        alone.append(matmuls_ms())
    nbytes = sum(w.numel() for w, _ in weights)
    mid = statistics.median
    print(f"one-row step {mid(steps):.1f} ms; its {len(calls)} matmuls alone {mid(alone):.1f} ms "
          f"({nbytes / mid(alone) / 1e6:.2f} GB/s); the rest of the step {mid(s - a for s, a in zip(steps, alone)):.1f} ms")


def attention(ckpt, args) -> None:
    from specpipe.kernels import native

    cfg = ckpt.config
    q = torch.randn(1, cfg.num_heads, cfg.head_dim)
    kv = [(torch.randn(args.context, cfg.num_kv_heads, cfg.head_dim), torch.randn(args.context, cfg.num_kv_heads, cfg.head_dim))
          for _ in range(cfg.num_layers)]
    flush = torch.randn(64 << 20)  # 256 MB
    passes = []
    for _ in range(args.steps):
        flush.add_(1.0)
        t0 = time.perf_counter()
        for k, v in kv:
            native.attention(q, k, v, None, cfg.head_dim ** -0.5, 1)
        passes.append((time.perf_counter() - t0) / cfg.num_layers * 1e6)
    print(f"attention of one row over {args.context} slots ({cfg.num_heads} / {cfg.num_kv_heads} heads of "
          f"{cfg.head_dim}), its cache cold: {statistics.median(passes):.1f} us a layer")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["head", "idle", "matmuls", "split", "attention"])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", type=_ints, default=[15, 30], help="head: last-stage sizes")
    ap.add_argument("--layers", default="15:30", help="idle: the stage's layers, START:END")
    ap.add_argument("--gaps", type=_ints, default=[0, 2, 5, 10, 20], help="idle: ms")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ckpt = open_checkpoint(resolve_model(args.model))
    {"head": head, "idle": idle, "matmuls": matmuls, "split": split, "attention": attention}[args.what](ckpt, args)


if __name__ == "__main__":
    main()
