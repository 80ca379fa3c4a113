"""`specpipe sim`: replay recorded traces on a cost profile (sim/events.py) and print the
predicted TBT, TTFT, throughput and what bound the run; for traces of real runs, the measured
figures and the error beside them.

    specpipe sim --trace run.json [more.json ...] --profile h100.json --link ib-100g [--driver-ms 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", nargs="+", required=True, help="traces written by `specpipe bench --trace`")
    p.add_argument("--profile", required=True,
                   help="a cost profile (`specpipe profile`), or the name of a shipped one (e.g. h100-80gb)")
    p.add_argument("--link", default="none",
                   help="link between stages: none, a preset (1gbe, 10gbe, ib-100g, nvlink3, nvlink4), a link measured "
                        "with the profile (loopback-s2) or LATENCY_MS:GBPS")
    p.add_argument("--stage-layers", default=None,
                   help="layers per stage, e.g. 10,10,..., or balanced: by the profile, for the rows a step of the "
                        "trace's mode sends, as the engine balances them (default: even split)")
    p.add_argument("--contention", type=float, default=None,
                   help="the nodes share their cores with other work: every step costs this factor times the "
                        "profile's (decode's ms a token under that load over idle: benchmarks/bench_contention.py; "
                        "default: the profile's own, 1.0 for an idle machine)")
    p.add_argument("--driver-ms", type=float, default=0.0, help="the driver's own time per step (default 0)")
    p.add_argument("--no-draft-cost", action="store_true",
                   help="the source costs nothing (n-gram); default: a trace with a model draft pays the profile's draft")
    p.add_argument("--json", default=None, help="also write every result as JSON here")


def parse_link(text: str, profile=None):
    """A preset, a link measured with the profile (e.g. loopback-s2), or LATENCY_MS:GBPS."""
    from specpipe.costs.profile import NO_LINK, Link
    from specpipe.costs.roofline import LINKS

    if text == "none":
        return NO_LINK
    if text in LINKS:
        return LINKS[text]
    if profile is not None and text in profile.links:
        return Link(**profile.links[text])
    try:
        latency, gbps = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--link must be none, one of {', '.join(LINKS)} or LATENCY_MS:GBPS, got {text!r}") from None
    return Link(text, latency, gbps)


def main(args: argparse.Namespace) -> int:
    from specpipe.config import ConfigError
    from specpipe.costs.balance import resolve_stage_layers
    from specpipe.costs.profile import load_profile
    from specpipe.loader.partition import parse_stage_layers
    from specpipe.sim.events import measured, simulate
    from specpipe.sim.trace import Trace

    try:
        profile = load_profile(args.profile)
        if args.contention is not None:
            profile = profile.with_contention(args.contention)
        link = parse_link(args.link, profile)
        traces = [(path, Trace.load(path)) for path in args.trace]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    layers = parse_stage_layers(args.stage_layers)
    print(f"profile {profile.device} ({profile.method}), link {link.name}, driver {args.driver_ms} ms/step"
          + (f", contention x{profile.contention:g}" if profile.contention != 1.0 else ""))
    print(f"{'trace':28s} {'mode':11s} {'S':>2s} {'tok/step':>8s} {'TBT ms':>8s} {'TTFT ms':>8s} {'tok/s':>7s} "
          f"{'bound by':>9s}  measured TBT / tok/s (error)")
    out = []
    for path, trace in traces:
        try:
            counts = resolve_stage_layers(layers, profile, profile.num_layers, trace.num_stages,
                                          trace.meta.get("mode", "pp"), trace.meta.get("width", 8))
            sim = simulate(trace, profile, counts, link, args.driver_ms,
                           draft_cost=not args.no_draft_cost and trace.meta.get("source", "ngram") != "ngram")
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        s = sim.summary()
        row = {"trace": str(path), "meta": trace.meta, "simulated": s}
        line = (f"{Path(path).name[:28]:28s} {trace.meta.get('mode', '?'):11s} {trace.num_stages:2d} "
                f"{s['tokens'] / max(s['steps'], 1):8.3f} {_ms(s['tbt_ms_median'])} {_ms(s['ttft_ms_median'])} "
                f"{s['throughput_tok_s']:7.2f} {s['bottleneck']:>9s}")
        if trace.meta.get("real"):
            m = measured(trace).summary()
            row["measured"] = m
            line += (f"  {_ms(m['tbt_ms_median'])} / {m['throughput_tok_s']:.2f} "
                     f"({_err(s['tbt_ms_median'], m['tbt_ms_median'])}, "
                     f"{_err(s['throughput_tok_s'], m['throughput_tok_s'])})")
        print(line)
        out.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _ms(v) -> str:
    return f"{v:8.1f}" if v is not None else f"{'-':>8s}"


def _err(predicted, real) -> str:
    if not predicted or not real:
        return "-"
    return f"{(predicted - real) / real:+.1%}"
