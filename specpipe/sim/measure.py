"""`specpipe profile`: measure a cost profile on this device, or derive one from a roofline.

    specpipe profile --out cpu.json [--model M] [--draft D] [--rows 1,2,...] [--contexts 256,...]
    specpipe profile --roofline h100-80gb --target-shape llama-3.1-70b --draft-shape llama-3.2-1b --out h100.json

Measured: one target decoder layer (the mean of two middle layers, no embedding or head), the
final norm + LM head (the last layer with the head, minus a layer), and a whole forward of the
draft model, each for n new rows after `context` cached tokens that all rows attend to (a tree
layer's shape), median of `--repeats` runs after a warm-up. On CUDA every timing synchronises.
The driver's own time per step is not a device cost and is not in the profile (`specpipe sim
--driver-ms`).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

DEFAULT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_CONTEXTS = [256, 1024, 2048, 4096, 8192]


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="write the profile (JSON) here")
    p.add_argument("--model", default=None, help="target GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft model to profile (a path; default: none)")
    p.add_argument("--rows", type=_ints, default=DEFAULT_ROWS, help="row counts (default 1,2,4,...,256)")
    p.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS, help="context lengths (default 256,...,8192)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median; default 3)")
    p.add_argument("--roofline", metavar="DEVICE", default=None,
                   help="derive the profile from a device's published specifications instead of measuring")
    p.add_argument("--target-shape", default="llama-3.1-70b", help="with --roofline: the target's shape preset")
    p.add_argument("--draft-shape", default="llama-3.2-1b", help="with --roofline: the draft's shape preset ('none')")
    p.add_argument("--stages", type=int, default=8, help="with --roofline: stages (checks a stage's weights fit)")


def main(args: argparse.Namespace) -> int:
    from specpipe.config import ConfigError

    if args.roofline:
        from specpipe.sim import roofline

        try:
            prof = roofline.build(args.roofline, args.target_shape,
                                  None if args.draft_shape == "none" else args.draft_shape,
                                  args.rows, args.contexts, args.stages)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        prof = measure(args)
    prof.save(args.out)
    print(f"wrote {args.out} ({prof.method}, {prof.device})", file=sys.stderr)
    return 0


def _timed(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    out = []
    for _ in range(max(1, repeats)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def forward_ms(model, kv, n: int, context: int, hidden: bool, repeats: int, device, dtype, sync) -> float:
    """One forward of n new rows after `context` cached tokens (all visible, like a tree layer)."""
    import numpy as np
    import torch

    from specpipe.model.runner import run_rows

    cfg = model.cfg
    data = (torch.randn(n, cfg.hidden_size, device=device, dtype=dtype) if hidden
            else torch.randint(0, cfg.vocab_size, (n,), device=device))
    mask = np.zeros((n, context + n), dtype=bool)
    mask[:, :context] = True
    mask[np.arange(n), context + np.arange(n)] = True  # each node sees the prefix and itself
    return _timed(lambda: run_rows(model, kv, data, [context] * n, range(context, context + n),
                                   range(context + n), mask), repeats, sync)


def measure(args: argparse.Namespace):
    import torch

    from specpipe.config import EngineConfig, StageSpec
    from specpipe.engine.default_model import default_model_path
    from specpipe.loader import open_checkpoint
    from specpipe.model.stage import build_stage
    from specpipe.sim.profile import CostProfile

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = EngineConfig(device=args.device, dtype=args.dtype).torch_dtype()
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    target = args.model or default_model_path()
    ckpt = open_checkpoint(target)
    cfg = ckpt.config
    L = cfg.num_layers
    mid = build_stage(ckpt, StageSpec(L // 2, L // 2 + 2, first=False, last=False), device, dtype)
    last = build_stage(ckpt, StageSpec(L - 1, L, first=False, last=True), device, dtype)
    top = max(args.contexts) + max(args.rows)
    mid_kv, last_kv = mid.make_kv_cache(top), last.make_kv_cache(top)
    total = len(args.contexts) * len(args.rows) * (3 if args.draft else 2)
    done = 0

    def progress(what: str) -> None:
        nonlocal done
        done += 1
        print(f"\rprofile: {done}/{total} {what:40s}", end="", file=sys.stderr, flush=True)

    layer_ms, head_ms = [], []
    for ctx in args.contexts:
        row, heads = [], []
        for n in args.rows:
            layer = forward_ms(mid, mid_kv, n, ctx, True, args.repeats, device, dtype, sync) / 2
            progress(f"target layer, {n} rows, context {ctx}")
            with_head = forward_ms(last, last_kv, n, ctx, True, args.repeats, device, dtype, sync)
            progress(f"target head, {n} rows, context {ctx}")
            row.append(layer)
            heads.append(max(0.0, with_head - layer))
        layer_ms.append(row)
        head_ms.append(heads)
    draft_ms, draft_meta = [], None
    if args.draft:
        dckpt = open_checkpoint(args.draft)
        dmodel = build_stage(dckpt, StageSpec.whole(dckpt.config), device, dtype)
        dkv = dmodel.make_kv_cache(top)
        for ctx in args.contexts:
            draft_ms.append([forward_ms(dmodel, dkv, n, ctx, False, args.repeats, device, dtype, sync)
                             for n in args.rows if progress(f"draft, {n} rows, context {ctx}") or True])
        draft_meta = {"path": str(args.draft), "num_layers": dckpt.config.num_layers,
                      "hidden_size": dckpt.config.hidden_size}
    print(file=sys.stderr)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    dtype_name = str(dtype).removeprefix("torch.")
    return CostProfile(
        device=f"{name}, torch {torch.__version__}, {dtype_name}", rows=list(args.rows), layer_ms=layer_ms,
        # The head reads no context: the median over contexts is its cost per row count.
        head_ms=[statistics.median(col) for col in zip(*head_ms)], draft_ms=draft_ms, contexts=list(args.contexts),
        method="measured",
        model={"path": str(target), "num_layers": L, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
        draft=draft_meta,
        assumptions=[f"measured with `specpipe profile`, median of {args.repeats} runs after a warm-up",
                     "layer: mean of two middle decoder layers; head: last layer with norm + LM head minus a layer",
                     "every row attends to the whole context and itself (one tree layer of one request)"],
        row_bytes=cfg.hidden_size * torch.empty((), dtype=dtype).element_size())
