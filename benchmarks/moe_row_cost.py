"""What rows cost on a mixture-of-experts layer (issue 59 item 6): a real run on this CPU.

A tree of W rows verified on a sparse layer reads the distinct experts its rows chose, up to W x k
where one row reads k. For each preset (costs/synthetic.py; `NAME:eN` keeps N of its experts, every
expert's shape kept, where a whole layer does not fit), one middle stage of ONE sparse layer (the
first: DeepSeek-V3 and GLM-4.6 have 3 dense layers before it) is built from random Q4_K_M blocks
through the real path (build_stage) and its real step (StageWorker.step) timed for each row count
below a context, with SparseMoE's counter (model/moe.py EXPERTS_READ) giving the distinct experts
each step ran. Two kinds of rows:

  random      independent hidden states: a random router spreads them evenly, so W rows read
              about E (1 - (1 - k/E)^W) experts; an upper bound for a tree, whose rows share context
  correlated  one hidden state plus noise of `--spread` times its scale per row: rows that route
              alike, for the spread between the two

It also times the LM head (final norm + head of a last stage, built with the preset's experts cut
to a few: the head's shape does not depend on them) and a whole forward of a draft file, and writes
a cost profile per preset (layer_ms: the sparse layer's 1-layer stage step, the stage's own
overhead included; experts_read: the random rows') that `specpipe sim` and
benchmarks/project_cluster.py use like a measured one.

  PYTHONPATH=. python benchmarks/moe_row_cost.py --synthetic glm-4.6 deepseek-v3 --draft DRAFT \
      --threads 1 --out benchmarks/results/moe_row_cost_epyc.json --profile-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_json  # noqa: E402
from specpipe.config import StageSpec  # noqa: E402
from specpipe.costs import synthetic  # noqa: E402
from specpipe.costs.measure import StageTimer  # noqa: E402
from specpipe.costs.profile import CostProfile  # noqa: E402
from specpipe.model.moe import EXPERTS_READ  # noqa: E402
from specpipe.model.stage import build_stage  # noqa: E402

HEAD_EXPERTS = {"deepseek-v3": 16, "glm-4.6": 8}  # the fewest experts the router's groups allow


class CorrelatedTimer(StageTimer):
    """Rows that are one hidden state plus `spread` x its scale of noise each."""

    spread = 0.1

    def _rows(self, rid, node_ids, parents, positions):
        from specpipe.messages import Rows

        n, h = len(node_ids), self.model.cfg.hidden_size
        if not hasattr(self, "_base"):
            self._base = torch.randn(1, h, dtype=self.dtype)
        data = self._base + self.spread * torch.randn(n, h, dtype=self.dtype)
        return Rows(rid, node_ids, parents, positions, data)


def timed(timer: StageTimer, n: int, ctx: int, repeats: int) -> tuple[float, float]:
    """(median ms of a step of n rows, distinct experts a step read, on average)."""
    EXPERTS_READ.reset()
    EXPERTS_READ.on = True
    try:
        ms = timer.ms(n, ctx, repeats)
    finally:
        EXPERTS_READ.on = False
    return ms, EXPERTS_READ.mean()


def layer_bytes(ckpt, layer: int) -> tuple[int, float]:
    """(bytes of the layer outside its routed experts, mean bytes of one routed expert)."""
    E = ckpt.config.moe.num_experts
    fixed = experts = 0
    for name in ckpt.names():
        if name.startswith(f"layers.{layer}."):
            if ".experts." in name:
                experts += ckpt.nbytes(name)
            else:
                fixed += ckpt.nbytes(name)
    return fixed, experts / E


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", nargs="+", required=True, help="presets (NAME or NAME:eN)")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spread", type=float, default=0.1, help="correlated rows: noise / the shared state's scale")
    ap.add_argument("--draft", default=None, help="a draft file whose whole forward the profiles price")
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile-dir", default=None, help="write profile_synthetic_NAME_moe.json here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, ctx, dtype, dev = [int(r) for r in args.rows.split(",")], args.context, torch.float32, torch.device("cpu")
    sync = lambda: None  # noqa: E731
    CorrelatedTimer.spread = args.spread
    draft_ms = []
    if args.draft:
        from specpipe.loader import open_checkpoint

        dck = open_checkpoint(args.draft)
        dtimer = StageTimer(build_stage(dck, StageSpec.whole(dck.config), dev, dtype), [ctx], rows, dev, dtype, sync, 1)
        draft_ms = [dtimer.ms(n, ctx, args.repeats) for n in rows]
        print(f"draft {args.draft}: {[round(x, 1) for x in draft_ms]} ms", file=sys.stderr, flush=True)
        del dtimer
    results = []
    for preset in args.synthetic:
        t0 = time.perf_counter()
        name, cfg = synthetic.model_config(preset)
        ckpt = synthetic.SyntheticCheckpoint(name, cfg)
        E, k, layer = cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.layers[0]
        fixed, expert = layer_bytes(ckpt, layer)
        model = build_stage(ckpt, StageSpec(layer, layer + 1, first=False, last=False), dev, dtype)
        print(f"{preset}: layer {layer} built in {time.perf_counter() - t0:.0f} s, max RSS {rss_gb():.1f} GB",
              file=sys.stderr, flush=True)
        kinds = {"random": StageTimer(model, [ctx], rows, dev, dtype, sync, 1),
                 "correlated": CorrelatedTimer(model, [ctx], rows, dev, dtype, sync, 1)}
        table = {kind: [] for kind in kinds}
        for n in rows:  # the kinds in turn, row count by row count: drift on a shared machine is shared
            for kind, timer in kinds.items():
                ms, read = timed(timer, n, ctx, args.repeats)
                table[kind].append({"rows": n, "ms": ms, "experts_read": read,
                                    "bytes_read": fixed + read * expert,
                                    "experts_random_router": E * (1 - (1 - k / E) ** n)})
            print(f"{preset} {n:3d} rows: " + "  ".join(f"{kind} {t[-1]['ms']:8.1f} ms {t[-1]['experts_read']:6.1f} "
                                                     f"experts" for kind, t in table.items()),
                  file=sys.stderr, flush=True)
        del kinds, model
        # The head: a last stage with few experts (the head's shape is the preset's).
        base = preset.partition(":e")[0]
        hname, hcfg = synthetic.model_config(f"{base}:e{HEAD_EXPERTS.get(base, 8)}")
        last = build_stage(synthetic.SyntheticCheckpoint(hname, hcfg), StageSpec(hcfg.num_layers - 1, hcfg.num_layers,
                                                                                first=False, last=True), dev, dtype)
        head_ms = []
        with torch.no_grad():
            for n in rows:
                x = torch.randn(n, cfg.hidden_size, dtype=dtype)
                last.lm_head(last.norm(x))
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    last.lm_head(last.norm(x))
                    times.append((time.perf_counter() - t) * 1e3)
                head_ms.append(statistics.median(times))
        del last
        print(f"{preset} head: {[round(x, 1) for x in head_ms]} ms, max RSS {rss_gb():.1f} GB",
              file=sys.stderr, flush=True)
        wb = synthetic.weight_bytes(ckpt, ckpt.nbytes)
        device = f"{platform.processor() or platform.machine()} CPU, {args.threads} threads, torch {torch.__version__}, float32"
        result = {"preset": preset, "num_experts": E, "top_k": k, "layer": layer, "layer_fixed_bytes": fixed,
                  "expert_bytes": expert, "layer_bytes": fixed + E * expert, "model_bytes": wb["total_bytes"],
                  "head_ms": head_ms, "draft_ms": draft_ms, "rows": table, "seconds": round(time.perf_counter() - t0)}
        results.append(result)
        if args.profile_dir:
            prof = CostProfile(
                device=device, rows=rows, layer_ms=[[r["ms"] for r in table["random"]]], head_ms=head_ms,
                draft_ms=[draft_ms] if draft_ms else [], contexts=[ctx], method="measured",
                model={"name": f"synthetic-{preset}", "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                       "vocab_size": cfg.vocab_size, "num_experts": E, "top_k": k, "type_mix": "q4_k_m",
                       "layer_bytes_mean": wb["layer_bytes_mean"], "head_bytes": wb["head_bytes"],
                       "total_bytes": wb["total_bytes"]},
                draft={"path": args.draft} if args.draft else None,
                assumptions=[f"benchmarks/moe_row_cost.py: synthetic Q4_K_M weights; a layer is the real step of a "
                             f"1-layer middle stage of sparse layer {layer} (its overhead included), median of "
                             f"{args.repeats} after a warm-up, rows of random hidden states at context {ctx}",
                             f"every layer priced as that sparse layer (the first {layer} dense layers too)",
                             "experts_read: the random rows' distinct experts (a random router's even spread, an upper "
                             "bound for a tree's rows, which share context)",
                             "head: final norm + LM head modules of a last stage, timed directly",
                             "messages between processes are not included: see the link (`specpipe sim --link`)"],
                row_bytes=cfg.hidden_size * 4, experts_read=[r["experts_read"] for r in table["random"]])
            out = Path(args.profile_dir) / f"profile_synthetic_{preset.replace(':', '_')}_moe.json"
            prof.save(out)
            print(f"wrote {out}", file=sys.stderr)
        write_json(args.out, {"what": "MoE row cost: one sparse layer's step by rows, real run, synthetic weights",
                              "context": ctx, "threads": args.threads, "repeats": args.repeats,
                              "spread": args.spread, "machine": platform.processor() or platform.machine(),
                              "results": results})  # after each preset: a long run keeps what it measured


if __name__ == "__main__":
    main()
