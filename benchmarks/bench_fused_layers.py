#!/usr/bin/env python3
"""A/B of the fused decoder layer (model/fused.py): the same GGUF built twice in one process,
with each layer as one native call and with the torch-written layers (SPECPIPE_FUSED_LAYERS=0);
a step of T rows after a prompt, the two versions alternating, median of --repeats each.

    PYTHONPATH=. python benchmarks/bench_fused_layers.py --model A.gguf [B.gguf ...]
        [--threads 2] [--prompt-tokens 128] [--rows 1 8] [--repeats 15] [--out results.json]
        [--quantization int8|int4] [--fused-only] [--isas avx512vnni amx]

Both versions give the same bits (checked here on the prompt's logits before timing).
--quantization requantizes the weights at load as `--draft-quantization` does (a Q4_0 draft);
--fused-only builds and times the fused version alone: a plain step timing of the model as
SpecPipe runs it, e.g. under `perf record`.  --isas A B ... times each version once per native
path (SPECPIPE_NATIVE_ISA, switched between calls in this process), alternating, and checks that
every path gives the step's logits the same bits: an A/B of the kernels' ISA paths on a whole
model, e.g. `--fused-only --isas avx512vnni amx`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specpipe.config import StageSpec
from specpipe.kernels import native
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import resolve_model  # noqa: E402


def build(ckpt, fused: bool, quantization: str | None):
    os.environ["SPECPIPE_FUSED_LAYERS"] = "1" if fused else "0"
    try:
        return build_stage(ckpt, StageSpec.whole(ckpt.config), quantization=quantization,
                           requantize=quantization is not None)
    finally:
        os.environ.pop("SPECPIPE_FUSED_LAYERS")


def set_isa(isa: str | None) -> None:
    """This process's native path from now on (None: the default, the best this CPU has)."""
    if isa is None:
        os.environ.pop("SPECPIPE_NATIVE_ISA", None)
    else:
        os.environ["SPECPIPE_NATIVE_ISA"] = isa
    native.reload_isa_code()


def label(name: str, isa: str | None) -> str:
    return name if isa is None else f"{name}/{isa}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=[None], help="GGUF files (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None)
    ap.add_argument("--fused-only", action="store_true")
    ap.add_argument("--isas", nargs="+", default=None, help="native paths to alternate (default: this process's)")
    args = ap.parse_args()
    isas = args.isas or [None]
    for isa in isas:
        if isa is not None and isa not in native.supported_isas():
            ap.error(f"--isas: {isa!r} is not a path of this CPU ({', '.join(native.supported_isas())})")
    torch.set_num_threads(args.threads)
    p, records = args.prompt_tokens, []
    for model in args.model:
        path = resolve_model(model)
        ckpt = open_checkpoint(path)
        versions = {"fused": build(ckpt, True, args.quantization)}
        if not args.fused_only:
            versions["torch-written"] = build(ckpt, False, args.quantization)
        n_fused = sum(layer.native is not None for layer in versions["fused"].layers.values())
        ids = torch.tensor(np.random.default_rng(0).integers(100, ckpt.config.vocab_size - 100, p + max(args.rows)))
        caches = {name: m.make_kv_cache(p + max(args.rows) + 1) for name, m in versions.items()}
        causal = np.tril(np.ones((p, p), dtype=bool))
        prompt = {name: run_rows(m, caches[name], ids[:p], list(range(p)), list(range(p)), list(range(p)), causal, [p - 1])
                  for name, m in versions.items()}
        same = args.fused_only or torch.equal(prompt["fused"], prompt["torch-written"])
        for t in args.rows:
            pos = list(range(p, p + t))
            mask = None if t == 1 else np.concatenate([np.ones((t, p), dtype=bool), np.tril(np.ones((t, t), dtype=bool))], 1)
            runs = [(name, isa) for name in versions for isa in isas]
            times = {run: [] for run in runs}
            logits = {}
            for _ in range(args.repeats + 1):  # the first of each is a warm-up
                for name, isa in runs:
                    set_isa(isa)
                    m = versions[name]
                    t0 = time.perf_counter()
                    logits[name, isa] = run_rows(m, caches[name], ids[p:p + t], pos, pos, list(range(p + t)), mask, [t - 1])
                    times[name, isa].append(time.perf_counter() - t0)
            set_isa(None)
            if len(isas) > 1:
                same = same and all(torch.equal(logits[run], logits[runs[0]]) for run in runs)
            ms = {label(*run): statistics.median(v[1:]) * 1e3 for run, v in times.items()}
            records.append({"model": Path(path).name, "rows": t, "fused_layers": n_fused,
                            "layers": len(versions["fused"].layers), "same_bits": same, **{f"{k}_ms": v for k, v in ms.items()}})
            ab = ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
            if len(ms) > 1:
                first = next(iter(ms.values()))
                ab += " (" + ", ".join(f"{v / first:.2f}x" for v in list(ms.values())[1:]) + f" the first; same bits: {same})"
            print(f"{Path(path).name}: {t} rows: {ab}; {n_fused}/{len(versions['fused'].layers)} layers fused", flush=True)
    if args.out:
        meta = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "quantization": args.quantization, "isas": args.isas, "threads": args.threads, "prompt_tokens": p, "repeats": args.repeats, "torch": torch.__version__,
                "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
