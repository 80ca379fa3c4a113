"""The memory-bandwidth floor of a decode step (issue 46, item 2): a CPU's one-row step reads every
weight of its layers once, so a node cannot beat (bytes it reads per token) / (its read bandwidth).

Measures, alternately in one process, `--rounds` times:
  bandwidth  a sum over a buffer far larger than the caches (torch, `--threads` threads, as a
             stage uses them): GB/s read;
             (one buffer on 4 KiB pages, one on huge pages; the faster counts);
  decode     one row of the real Qwen2.5-Coder 1.5B Q4_K_M file's whole model (embedding, 28
             layers, LM head) after a `--context`-token prompt, through the stage's own step;
and prints the bytes a token reads (weights of the layers + the LM head + the KV cache read at
that context), the floor they imply and the measured step as a fraction of the floor (floor /
measured: 1.0 = at the memory's pace). For each cost profile given (`specpipe profile`, real or
`--synthetic`), the same per layer and per stage of an S-stage split (the last with the head).

  PYTHONPATH=. python benchmarks/memory_floor.py --model TARGET --threads 1 --rounds 5 \
      --profiles benchmarks/results/profile_synthetic_*_xeon.json --out benchmarks/results/memory_floor_xeon.json
"""

from __future__ import annotations

import argparse
import statistics
import time
import sys
from pathlib import Path

import torch

from specpipe.config import StageSpec
from specpipe.costs import synthetic
from specpipe.costs.balance import balanced_stage_layers
from specpipe.costs.measure import StageTimer
from specpipe.costs.profile import load_profile
from specpipe.loader import open_checkpoint
from specpipe.loader.weight_memory import weight_tensor
from specpipe.model.stage import build_stage, weight_nbytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_name, write_json  # noqa: E402

BUFFER_BYTES = 1 << 30  # 1 GiB: many times any L3 here


def read_bandwidth(buf: torch.Tensor, repeats: int = 5) -> float:
    """GB/s (10^9 bytes) of the fastest of `repeats` sums over `buf` (float32, read once each)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def file_weight_bytes(path: str, cfg) -> dict:
    """`synthetic.weight_bytes`' parts counted from a GGUF file's own tensors (any mix of types,
    e.g. a file requantized to Q2_K or IQ2_XXS), rather than from a preset's shapes."""
    from gguf import GGUFReader

    layers, head, embed = 0, 0, 0
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    for name, n in tensors.items():
        if name.startswith("blk."):
            layers += n
        elif name in ("output.weight", "output_norm.weight"):
            head += n
        elif name == "token_embd.weight":
            embed = n
    if "output.weight" not in tensors:
        head += embed  # tied: the head reads the embedding's bytes
    L = cfg.num_layers
    if cfg.moe is not None:
        raise SystemExit("memory_floor.py: counting a sparse model's active bytes from its file is not done; use --preset")
    return {"layer_bytes_mean": layers / L, "layer_bytes_active_mean": layers / L, "head_bytes": head,
            "embed_bytes": embed, "kv_bytes_per_token_layer": cfg.kv_values_per_token * 4,
            "total_bytes": layers + head + (embed if "output.weight" in tensors else 0)}


def bytes_per_token(b: dict, layers: int, last: bool, context: int, active: bool = True) -> float:
    per_layer = b["layer_bytes_active_mean"] if active else b["layer_bytes_mean"]
    return layers * (per_layer + b["kv_bytes_per_token_layer"] * context) + (b["head_bytes"] if last else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the Qwen2.5-Coder 1.5B Q4_K_M file")
    ap.add_argument("--preset", default="qwen2.5-coder-1.5b", help="its shapes (for the byte count)")
    ap.add_argument("--bytes-from-file", action="store_true",
                    help="count the bytes a token reads from the GGUF file's own tensors (a requantized file: "
                         "Q2_K, IQ2_XXS, ...) instead of the preset's Q4_K_M types")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profiles", nargs="*", default=[])
    ap.add_argument("--stages", type=int, default=8, help="the split the per-stage rows are for")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = open_checkpoint(args.model)
    name, cfg = synthetic.model_config(args.preset)
    shapes = synthetic.SyntheticCheckpoint(name, cfg)  # the file's types (tests/costs/test_synthetic.py)
    b = file_weight_bytes(args.model, ckpt.config) if args.bytes_from_file else synthetic.weight_bytes(shapes, shapes.nbytes)
    model = build_stage(ckpt, StageSpec.whole(ckpt.config))
    held = weight_nbytes(model)
    timer = StageTimer(model, [args.context], [1], torch.device("cpu"), torch.float32, lambda: None, 1)
    # Two probe buffers: torch's own memory (4 KiB pages) and huge pages, as the loader's weights are
    # (loader/weight_memory.py); the floor takes the faster read, so it is not flattered.
    small_pages = torch.ones(BUFFER_BYTES // 4)
    huge_pages = weight_tensor((BUFFER_BYTES // 4,), torch.float32).fill_(1.0)
    read = bytes_per_token(b, cfg.num_layers, True, args.context) + b["embed_bytes"] / cfg.vocab_size
    rounds = []
    for r in range(args.rounds):
        probes = {"gb_s_4k_pages": read_bandwidth(small_pages), "gb_s_huge_pages": read_bandwidth(huge_pages)}
        gbs = max(probes.values())
        ms = timer.ms(1, args.context, args.repeats)
        floor = read / (gbs * 1e6)
        rounds.append({"gb_s": gbs, **probes, "decode_ms": ms, "floor_ms": floor, "fraction": floor / ms})
        print(f"round {r + 1}: read {probes['gb_s_4k_pages']:.2f} GB/s (4 KiB pages) / "
              f"{probes['gb_s_huge_pages']:.2f} (huge pages), decode {ms:.2f} ms, floor {floor:.2f} ms, "
              f"fraction {floor / ms:.2f}", flush=True)
    med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
    best_gbs = max(x["gb_s"] for x in rounds)
    summary = {"model": args.model, "bytes_from": "file" if args.bytes_from_file else f"preset {args.preset}",
               "bytes_per_token": read, "weights_held": held, "context": args.context,
               "median": med, "best_gb_s": best_gbs, "fraction_of_medians": read / (med["gb_s"] * 1e6) / med["decode_ms"]}
    print(f"Qwen 1.5B: {read / 1e6:.1f} MB a token (held {held / 1e6:.1f} MB); median read {med['gb_s']:.2f} GB/s "
          f"(best {best_gbs:.2f}), decode {med['decode_ms']:.2f} ms, floor {read / (med['gb_s'] * 1e6):.2f} ms, "
          f"median of the rounds' fractions {med['fraction']:.2f}")
    models = []
    for path in args.profiles:
        prof = load_profile(path)
        pname = prof.model.get("name", path).removeprefix("synthetic-")
        if "layer_bytes_mean" not in prof.model:
            continue
        pb, ctx = prof.model, prof.contexts[0]
        L = prof.num_layers
        counts = balanced_stage_layers(prof, L, args.stages, 1, ctx)
        layer_read = bytes_per_token(pb, 1, False, ctx)
        layer_floor = layer_read / (med["gb_s"] * 1e6)
        stage_reads = [bytes_per_token(pb, n, s == len(counts) - 1, ctx) for s, n in enumerate(counts)]
        stage_ms = [prof.stage(n, s == len(counts) - 1, 1, ctx) for s, n in enumerate(counts)]
        slowest = max(range(len(counts)), key=lambda s: stage_ms[s])
        line = {"profile": path, "model": pname, "context": ctx, "layer_bytes": layer_read,
                "layer_bytes_all_experts": bytes_per_token(pb, 1, False, ctx, active=False),
                "layer_floor_ms": layer_floor, "layer_ms": prof.layer(1, ctx), "head_bytes": pb["head_bytes"],
                "head_floor_ms": pb["head_bytes"] / (med["gb_s"] * 1e6), "head_ms": prof.head(1),
                "stage_layers": counts, "stage_bytes": stage_reads, "stage_ms": stage_ms,
                "slowest_stage": slowest + 1,
                "slowest_floor_ms": stage_reads[slowest] / (med["gb_s"] * 1e6), "slowest_ms": stage_ms[slowest]}
        line["layer_fraction"] = line["layer_floor_ms"] / line["layer_ms"]
        line["slowest_fraction"] = line["slowest_floor_ms"] / line["slowest_ms"]
        models.append(line)
        print(f"{pname}: a layer reads {layer_read / 1e6:.1f} MB (active), floor {layer_floor:.2f} ms, measured "
              f"{line['layer_ms']:.2f} ms ({line['layer_fraction']:.2f}); head {pb['head_bytes'] / 1e6:.0f} MB, "
              f"{line['head_floor_ms']:.2f} / {line['head_ms']:.2f} ms; S={args.stages} {counts}: slowest stage "
              f"{slowest + 1} reads {stage_reads[slowest] / 1e6:.0f} MB, floor {line['slowest_floor_ms']:.1f} ms, "
              f"measured {line['slowest_ms']:.1f} ms ({line['slowest_fraction']:.2f})")
    cpu = cpu_name()
    out = {"what": "read bandwidth and the decode step as a fraction of its memory floor (real run)", "cpu": cpu,
           "threads": args.threads, "rounds": rounds, "qwen1.5b": summary, "models": models}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
