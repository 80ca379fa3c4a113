#!/usr/bin/env python3
"""--cluster ray on hosts with addresses of their own (network namespaces on a bridge, a Ray node
in each: tests/netns_helpers.py), every number a real run:

  links     three hosts, the a<->b pair slowed by tc's tbf (10 Mbit/s, burst 32kbit, latency
            400ms); three stages of equal layer counts. Decode ms per token of one greedy request
            for the planner's order (which measured the links) and for every order by hand; the
            orders that put a next to b cross the slow link every step. pp (one row a step) and
            specpipe (a tree layer of --tree-width rows a step) each.
  faults    a two-stage pipeline over the three hosts; `--trials` times, over the modes and the
            faults (a host frozen with SIGSTOP and resumed once the pipeline restarted without
            it; a host partitioned, its link down, healed after; a host lost, its Ray node
            killed, started again after; with --kinds slow too: the host's link at 10 Mbit/s
            from the fault to the request's end): tokens against an undisturbed run, requests
            lost, and the time from the fault to the next token. One engine serves every trial of a mode:
            the hosts come back between trials and the backend finds them again.
  stream    the first load of a model whose file only the driver has (every stage streamed,
            hashed as it lands) against the second (every stage from the hosts' caches), and
            (stage bytes / the slowest link's measured rate) + the second load, the bound the
            first should stay within 1.3x of.

  python benchmarks/cluster_hosts.py --model PATH --only links --out benchmarks/results/cluster_hosts_links.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns_helpers import Hosts, RayHosts  # noqa: E402

from specpipe.config import EngineConfig  # noqa: E402
from specpipe.engine.engine import Engine  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."
MODES = ("pp", "specpipe", "specpipe-db")


def cluster(n: int = 3):
    net = Hosts(n)
    try:
        rh = RayHosts(net, Path(tempfile.mkdtemp(prefix="specpipe-hosts-")))
    except BaseException:
        net.close()
        raise
    ray.init(address=rh.address, _node_ip_address=net.bridge_address, log_to_driver=False)
    return net, rh


def close(net, rh) -> None:
    import shutil

    ray.shutdown()
    rh.close()
    net.close()
    shutil.rmtree(rh.root, ignore_errors=True)  # the hosts' weight caches: gigabytes after many re-plans


def base(args, **extra) -> EngineConfig:
    return EngineConfig(model=args.model, max_context=512, max_num_seqs=4, kv_memory="64MiB",
                        weight_chunk=args.weight_chunk, **extra)


def decode_ms(engine: Engine, tokens: int, repeats: int) -> tuple[float, list[int]]:
    """Median ms per output token of one greedy request, from the first token."""
    times, ids = [], []
    for _ in range(repeats):
        stamps: list[float] = []
        out = engine.generate(PROMPT, SamplingParams(max_tokens=tokens), chat=True, ignore_eos=True,
                              on_text=lambda _t: stamps.append(time.perf_counter()))
        ids = out.token_ids
        if len(stamps) >= 2:
            times.append((stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1))
    return statistics.median(times), ids


def node_ids(net: Hosts) -> dict[str, str]:
    """host address -> its Ray node id."""
    from specpipe.cluster.placement import live_nodes

    return {n["NodeManagerAddress"]: n["NodeID"] for n in live_nodes()}


def links(args) -> dict:
    import specpipe.cluster.ray_backend as rb

    net, rh = cluster(3)
    a, b, c = net.hosts
    out: dict = {"slow pair": [a.address, b.address], "rate": args.rate, "modes": {}}
    real_plan = rb.plan_split
    try:
        net.throttle(a, b, args.rate)
        ids = node_ids(net)
        name = {ids[h.address]: h.address for h in net.hosts}
        orders = [None] + [[ids[h.address] for h in p] for p in itertools.permutations(net.hosts)]
        L = num_layers(args)
        counts = [L // 3 + (i < L % 3) for i in range(3)]
        for mode in args.link_modes:
            res = out["modes"].setdefault(mode, {"orders": {}})
            for r in range(args.rounds):  # every order once a round: the machine's pace drifts
                for order in orders:
                    rb.plan_split = functools.partial(real_plan, order=order) if order else real_plan
                    msgs: list[str] = []
                    engine = Engine(base(args, mode=mode, cluster="ray", stages=3, stage_layers=counts,
                                         draft="ngram" if mode != "pp" else None, tree_width=args.tree_width),
                                    progress=msgs.append)
                    try:
                        placed = [name[s.node.node_id] for s in engine.cluster.plan.stages]
                        ms, _ = decode_ms(engine, args.tokens, args.repeats)
                    finally:
                        engine.close()
                    crosses = any({x, y} == {a.address, b.address} for x, y in zip(placed, placed[1:]))
                    label = "planned" if order is None else " > ".join(placed)
                    entry = res["orders"].setdefault(label, {"order": placed, "crosses_slow_link": crosses,
                                                             "ms_each_round": []})
                    entry["ms_each_round"].append(ms)
                    if order is None and r == 0:
                        res["measured_links"] = [m for m in msgs if m.startswith("link ")]
                        res["plan"] = [m for m in msgs if m.startswith(("plan (", "  "))]
                    print(f"{mode} round {r + 1} {label}: {ms:.1f} ms/token (crosses the slow link: {crosses})",
                          file=sys.stderr, flush=True)
            for entry in res["orders"].values():
                entry["ms_per_token"] = statistics.median(entry["ms_each_round"])
            hand = {k: v for k, v in res["orders"].items() if k != "planned"}
            planned = res["orders"]["planned"]["ms_per_token"]
            crossing = [v["ms_per_token"] for v in hand.values() if v["crosses_slow_link"]]
            best = min(v["ms_per_token"] for v in hand.values())
            res["planned_vs_crossing_mean"] = statistics.mean(crossing) / planned
            res["planned_vs_crossing_best"] = min(crossing) / planned
            res["planned_vs_best_by_hand"] = best / planned
    finally:
        rb.plan_split = real_plan
        close(net, rh)
    return out


def faults(args) -> dict:
    net, rh = cluster(3)
    trials: list[dict] = []
    L = num_layers(args)
    kinds = tuple(args.kinds)
    per_mode = -(-args.trials // len(args.fault_modes))
    try:
        for mode in args.fault_modes:
            cfg = base(args, mode=mode, cluster="ray", stages=2, stage_layers=[L - L // 2, L // 2],
                       stage_timeout_s=args.stage_timeout, draft="ngram" if mode != "pp" else None,
                       restart_stages=per_mode + 2)
            log: list[tuple[float, str]] = []  # the engine's progress lines, timed: where a restart's time goes
            engine = Engine(cfg, progress=lambda m: log.append((time.perf_counter(), m)))
            try:
                want = engine.generate(PROMPT, SamplingParams(max_tokens=args.tokens), chat=True).token_ids
                for t in range(per_mode):
                    kind = kinds[t % len(kinds)]
                    restored = every_host_up(net, rh)
                    if restored:
                        print(f"  started again (Ray had ended them): {restored}", file=sys.stderr)
                    log.clear()
                    trials.append(one_fault(engine, net, rh, kind, mode, want, args, log))
                    print(f"faults {mode} {kind}: {trials[-1]}", file=sys.stderr, flush=True)
                    # Each trial kept as it ends: a run of 30 takes long enough to be cut short.
                    Path(args.out).with_suffix(".trials.json").write_text(json.dumps(trials, indent=1))
            finally:
                engine.close()
    finally:
        close(net, rh)
    gaps = [t["fault_to_next_token_s"] for t in trials if t["fault_to_next_token_s"] is not None]
    return {"trials": trials, "count": len(trials), "stage_timeout_s": args.stage_timeout,
            "tokens_different": sum(not t["same_tokens"] for t in trials),
            "requests_lost": sum(t["lost"] for t in trials),
            "fault_to_next_token_s_median": statistics.median(gaps) if gaps else None,
            "fault_to_next_token_s_max": max(gaps) if gaps else None,
            "by_kind": {k: statistics.median([t["fault_to_next_token_s"] for t in trials
                                              if t["kind"] == k and t["fault_to_next_token_s"] is not None] or [0])
                        for k in kinds}}


def every_host_up(net: Hosts, rh: RayHosts) -> list[str]:
    """Each host with a live Ray node before a trial: a partition longer than Ray's health checks
    (or a busy machine missing them) makes the GCS declare a node dead, and its raylet then exits
    when it hears so; such a host gets a node again, as an operator would start it."""
    from netns_helpers import end_processes

    live = node_ids(net)
    gone = [h for h in net.hosts if h.address not in live]
    for h in gone:
        end_processes(rh.pids(h))
        rh.start_node(h)
    if gone:
        time.sleep(2.0)
    return [h.address for h in gone]


def one_fault(engine: Engine, net: Hosts, rh: RayHosts, kind: str, mode: str, want: list[int], args,
              log: list = ()) -> dict:
    """One request with `kind` applied to the host of the last stage after 8 tokens; the host
    brought back once the pipeline has restarted without it (frozen: resumed; partitioned:
    healed; lost: its node started again)."""
    last = engine.cluster.plan.stages[-1].node.name.split("/")[0]
    host = next(h for h in net.hosts if h.address == last)
    stamps: list[float] = []
    state: dict = {}
    restarts = engine.core().stage_restarts

    def bring_back() -> None:
        if kind == "freeze":
            rh.thaw(state.pop("pids"))
        elif kind == "partition":
            host.link(True)  # (a partition Ray's health checks saw ends the node: every_host_up)
        elif kind == "slow":
            net.unthrottle()
        else:
            rh.start_node(host)

    def on_text(_t) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == 8 and "at" not in state:
            state["at"] = time.perf_counter()
            if kind == "freeze":
                state["pids"] = rh.freeze(host)
            elif kind == "partition":
                host.link(False)
            elif kind == "slow":
                net.throttle_host(host, "10mbit")
            else:
                rh.kill(host)
        if "at" in state and "back" not in state and engine.core().stage_restarts > restarts:
            state["back"] = True
            bring_back()

    lost = False
    try:
        got = engine.generate(PROMPT, SamplingParams(max_tokens=args.tokens), chat=True, on_text=on_text).token_ids
    except Exception as e:  # noqa: BLE001
        got, lost = [], True
        print(f"  request lost: {type(e).__name__}: {e}", file=sys.stderr)
    if "at" in state and "back" not in state:  # no restart (a slow link survives as it is)
        bring_back()
    after = [s for s in stamps if s > state.get("at", float("inf"))]
    return {"mode": mode, "kind": kind, "host": host.address, "same_tokens": got == want, "lost": lost,
            "fault_to_next_token_s": (after[0] - state["at"]) if after else None,
            "restarts": engine.core().stage_restarts - restarts,
            # The progress lines from the fault on, seconds after it: the restart's phases.
            "log": [f"{t - state['at']:+.1f} s {m}" for t, m in log if "at" in state and t >= state["at"]]
            + ([f"{after[0] - state['at']:+.1f} s next token"] if after else [])}


def stream(args) -> dict:
    import os

    net, rh = cluster(3)
    L = num_layers(args)
    out: dict = {}
    try:
        for run in ("first", "second"):
            msgs: list[str] = []
            t0 = time.perf_counter()
            engine = Engine(base(args, mode="pp", cluster="ray", stages=3,
                                 stage_layers=[L // 3 + (i < L % 3) for i in range(3)]), progress=msgs.append)
            try:
                ttft = {}
                engine.generate(PROMPT, SamplingParams(max_tokens=2), chat=True,
                                on_text=lambda _t: ttft.setdefault("t", time.perf_counter()))
                stage_bytes = [engine.cluster._digests[sp][0].total for sp in engine.cluster.plan.specs()]
                rates = [ln.bytes_per_s for (x, y), ln in engine.cluster.links.items() if x == "driver"]
            finally:
                engine.close()
            out[run] = {"engine_to_first_token_s": ttft["t"] - t0, "stage_mib": [b / 2**20 for b in stage_bytes],
                        "weights_lines": [m for m in msgs if m.startswith("weights to node")]}
            print(f"stream {run}: {out[run]['engine_to_first_token_s']:.1f} s to the first token", file=sys.stderr)
        slowest = min(rates)
        out["slowest_driver_link_mib_s"] = slowest / 2**20
        out["bound_s"] = max(stage_bytes) / slowest + out["second"]["engine_to_first_token_s"]
        out["first_vs_bound"] = out["first"]["engine_to_first_token_s"] / out["bound_s"]
        out["cache_dirs"] = {ns: str(p) for ns, p in rh.caches.items()}
        out["weight_chunk"] = args.weight_chunk or os.environ.get("SPECPIPE_WEIGHT_CHUNK", "") or "8MiB (default)"
    finally:
        close(net, rh)
    return out


def num_layers(args) -> int:
    from specpipe.loader import open_checkpoint

    return open_checkpoint(args.model).config.num_layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--weight-chunk", default=None,
                   help="the streamed weight chunk (as the CLI's --weight-chunk; default $SPECPIPE_WEIGHT_CHUNK, else 8MiB)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="links: every order once a round (medians)")
    p.add_argument("--rate", default="10mbit", help="links: the slow pair's tbf rate")
    p.add_argument("--tree-width", type=int, default=8)
    p.add_argument("--link-modes", nargs="*", default=["pp", "specpipe"])
    p.add_argument("--fault-modes", nargs="*", default=list(MODES))
    p.add_argument("--trials", type=int, default=30, help="faults: in all, spread over the modes")
    p.add_argument("--stage-timeout", type=float, default=10.0)
    p.add_argument("--kinds", nargs="*", default=["freeze", "partition", "loss"],
                   help="faults: taken in turn (also: slow, the host's link at 10 Mbit/s from then on)")
    p.add_argument("--only", nargs="*", default=["links", "faults", "stream"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.model is None:
        from specpipe.loader.default_model import default_model_path

        args.model = str(default_model_path())
    import os

    result = {"model": args.model, "cpu": _cpu(), "tokens": args.tokens, "method": "real run",
              "load_average_at_start": os.getloadavg()}
    for part in args.only:
        result[part] = {"links": links, "faults": faults, "stream": stream}[part](args)
        result["load_average_at_end"] = os.getloadavg()
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v if k != "faults" else {m: n for m, n in v.items() if m != "trials"}
                      for k, v in result.items()}, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
