"""`specpipe bench`: every chosen mode on the same prompts at the chosen stage counts, in one run.

    specpipe bench --runs pp,tree:depth=7,specpipe,specpipe:layers=2 --stages 2 --max-tokens 64 \\
                   --result-json r.json --result-md r.md [--trace-dir traces/] [--plots docs/img/]

Two methods, said in every output:
  real run     one Engine per stage count (stage processes when S > 1) serves every run on the
               same prompts; wall-clock TTFT, TBT (median, p90 over requests), throughput.
  --oracle     step counts: the stages are replaced by OraclePipeline, which delays and prunes rows
               exactly as S stages do and answers with the target's greedy tokens (computed for
               real once, in-process). Exact for greedy decoding, and every output is checked
               against that reference (the lossless property); no wall clock. Traces from it are
               what `specpipe sim` turns into time at any S and on any device profile.
Per run and per prompt group: tokens per step, hit rate, acceptance length (tree: tokens per
round), and speed-ups against `pp` (or `pp-cb` when no `pp` ran) and against the best `tree` run
(TBT for real runs; tokens per step for the oracle).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specpipe.bench.metrics import percentile

def _draft_timing(value: str) -> str:
    if value not in ("sync", "async"):
        raise ValueError(value)
    return value


MODE_OPTIONS = {"width": int, "depth": int, "layers": lambda v: v if v == "auto" else int(v),
                "draft": _draft_timing}  # draft=async: --draft-async for this run


@dataclass(frozen=True)
class RunSpec:
    mode: str
    options: tuple = ()  # ((name, value), ...) of MODE_OPTIONS

    @property
    def label(self) -> str:
        return self.mode + "".join(f" {k}={v}" for k, v in self.options)

    def get(self, name: str, default=None):
        return dict(self.options).get(name, default)


def parse_runs(text: str) -> list[RunSpec]:
    """'pp,tree:depth=7:width=8,specpipe:layers=2' -> RunSpecs."""
    from specpipe.config import MODES

    runs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        mode, *opts = item.split(":")
        if mode not in MODES:
            raise ValueError(f"--runs: unknown mode {mode!r} in {item!r}; modes: {', '.join(MODES)}")
        options = []
        for opt in opts:
            name, _, value = opt.partition("=")
            if name not in MODE_OPTIONS or not value:
                raise ValueError(f"--runs: {opt!r} in {item!r} is not NAME=VALUE with NAME one of "
                                 f"{', '.join(MODE_OPTIONS)}")
            try:
                options.append((name, MODE_OPTIONS[name](value)))
            except ValueError:
                raise ValueError(f"--runs: {opt!r} in {item!r}: not a valid value") from None
        runs.append(RunSpec(mode, tuple(options)))
    if not runs:
        raise ValueError("--runs is empty")
    return runs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", default="pp,tree,specpipe",
                   help="comma-separated MODE[:width=W][:depth=D][:layers=d|auto][:draft=async] (draft=async: --draft-async for that run; under --oracle it needs --cost-profile; default pp,tree,specpipe)")
    p.add_argument("--stages", default="2", help="comma-separated stage counts (default 2)")
    p.add_argument("--model", default=None, help="target GGUF or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="speculative source (default ngram)")
    p.add_argument("--draft-vocab", type=int, default=None, help="a draft model proposes from N tokens only")
    p.add_argument("--draft-quantization", default=None, choices=["int8", "int4"],
                   help="a draft model's weights requantized at load to Q8_0 / Q4_0")
    p.add_argument("--stage-layers", default=None,
                   help="layers per stage (one --stages value), or balanced: by --cost-profile for each S and run "
                        "(default: even split)")
    p.add_argument("--tree-width", type=int, default=8, help="W unless a run says width= (default 8)")
    p.add_argument("--tree-depth", type=int, default=4, help="tree mode's D unless a run says depth= (default 4)")
    p.add_argument("--dataset", default="specbench", help="specbench (Spec-Bench's six groups), or a JSONL file of prompts")
    p.add_argument("--dataset-path", default=None, help="Spec-Bench question.jsonl (default: found, see docs)")
    p.add_argument("--prompts-per-group", type=int, default=2, help="Spec-Bench prompts per group (default 2)")
    p.add_argument("--groups", default=None, help="Spec-Bench groups to use (default: all six)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt at most (default 64)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in the pipeline at once (default 1: one after another, for latency)")
    p.add_argument("--oracle", action="store_true", help="step counts against oracle stages (no wall clock)")
    p.add_argument("--max-step-rows", type=int, default=64, help="row budget per step of pp-cb/specpipe-db")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--transport", default="auto", help="inproc | processes (default: processes when S > 1)")
    p.add_argument("--stage-threads", type=int, default=0, help="CPU threads per stage process (default: cores / S)")
    p.add_argument("--cluster", default="local", choices=["local", "ray"],
                   help="ray: the stages as actors on the Ray cluster this machine joined (at most --stages, planned)")
    p.add_argument("--ray-address", default="auto", help="--cluster ray: the cluster's address (default auto)")
    p.add_argument("--weight-chunk", default=None,
                   help="--cluster ray: streamed weight chunk size, e.g. 256KiB (default $SPECPIPE_WEIGHT_CHUNK, else 8MiB)")
    p.add_argument("--weight-cache-max", default=None,
                   help="--cluster ray: a node's weight cache cap, a size or a share of its disk space (default 50%%)")
    p.add_argument("--trace-dir", default=None, help="write one trace per run and stage count here")
    p.add_argument("--plots", default=None, help="write PNG pictures here (an --oracle timeline needs --profile)")
    p.add_argument("--profile", default=None,
                   help="cost profile to simulate the timeline picture of --oracle runs with (real runs draw "
                        "the stages' measured times)")
    p.add_argument("--cost-profile", default=None,
                   help="what runs with layers=auto plan with (a profile file or shipped name; default: rows nearly free)")
    p.add_argument("--result-json", default=None, help="write every run's figures (JSON) here")
    p.add_argument("--result-md", default=None, help="write the Markdown tables here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class Outcome:
    """One request of one run."""

    group: str
    tokens: int
    steps: int
    hits: int
    verifications: int
    rounds: int
    ttft_ms: Optional[float] = None
    tbt_ms: Optional[float] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, what the prefix cache held
    block_shapes: dict[str, int] = field(default_factory=dict)  # specpipe: "d x w" -> steps
    draft_bound_steps: int = 0  # steps whose drafting outlasted the stages' compute (real runs)
    draft_calls: int = 0  # source calls (one batched draft forward each)


@dataclass
class RunResult:
    spec: RunSpec
    stages: int
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    trace: Optional[str] = None


def load_prompts(args) -> list[dict]:
    from specpipe.bench import datasets

    if args.dataset == "specbench":
        wanted = set(args.groups.split(",")) if args.groups else set(datasets.GROUPS)
        unknown = wanted - set(datasets.GROUPS)
        if unknown:
            raise ValueError(f"--groups: unknown {', '.join(sorted(unknown))}; groups: {', '.join(datasets.GROUPS)}")
        return [{"group": p["group"], "text": p["text"]}
                for p in datasets.load_prompts(args.prompts_per_group, path=args.dataset_path) if p["group"] in wanted]
    return [{"group": "all", "text": p["prompt"]} for p in datasets.load_jsonl(args.dataset)]


def main(args: argparse.Namespace) -> int:
    from specpipe.config import ConfigError

    try:
        runs = parse_runs(args.runs)
        stage_counts = [int(s) for s in args.stages.split(",")]
        prompts = load_prompts(args)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    if not prompts:
        raise ConfigError("no prompts to run")
    from tqdm import tqdm

    bar = tqdm(total=len(runs) * len(stage_counts) * len(prompts), unit="req", disable=args.no_progress,
               file=sys.stderr)
    try:
        results = (_oracle if args.oracle else _real)(args, runs, stage_counts, prompts, bar)
    finally:
        bar.close()
    report = build_report(args, results)
    print(format_markdown(report))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=1) + "\n")
    if args.result_md:
        Path(args.result_md).write_text(format_markdown(report) + "\n")
    if args.plots:
        draw(args, report, results)
    return 0


def _tracer(args, run: RunSpec, S: int, real: bool, source: Optional[str], stage_layers: list[int]):
    if not (args.trace_dir or args.plots):
        return None
    from specpipe.sim.trace import StepTracer

    return StepTracer(S, {"mode": run.mode, "label": run.label, "real": real, "source": source or "none",
                          "stage_layers": stage_layers, "width": run.get("width", args.tree_width),
                          "model": args.model or "SmolLM2-135M-Instruct", "concurrency": args.concurrency,
                          "draft_vocab": args.draft_vocab, "draft_quantization": args.draft_quantization,
                          **dict(run.options)})


def _save_trace(args, tracer, run: RunSpec, S: int, groups: dict[int, str]) -> Optional[str]:
    """`groups`: request id -> prompt group, kept in the trace so that its simulation can be
    broken down the same way."""
    if tracer is None:
        return None
    trace = tracer.finish()
    trace.meta["groups"] = {str(rid): g for rid, g in groups.items() if rid in trace.requests}
    out = Path(args.trace_dir or args.plots)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"trace_{run.label.replace(' ', '_').replace('=', '')}_s{S}.json"
    trace.save(path)
    return str(path)


def _config(args, S: int, runs: list[RunSpec], **extra):
    from specpipe.config import EngineConfig

    deepest = max((r.get("layers", 1) for r in runs if r.mode.startswith("specpipe")), default=1,
                  key=lambda d: 99 if d == "auto" else d)
    from specpipe.loader.partition import parse_stage_layers

    return EngineConfig(model=args.model, mode="specpipe", stages=S, draft=args.draft, draft_vocab=args.draft_vocab,
                        stage_layers=parse_stage_layers(args.stage_layers) if S > 1 else None,
                        draft_quantization=args.draft_quantization, tree_width=args.tree_width,
                        tree_depth=args.tree_depth, layers_per_step=deepest, device=args.device,
                        max_num_seqs=max(1, args.concurrency), max_step_rows=args.max_step_rows,
                        stage_timeout_s=600, cost_profile=args.cost_profile,
                        **{"transport": args.transport, "stage_threads": args.stage_threads,
                           "cluster": args.cluster, "ray_address": args.ray_address,
                           "weight_chunk": args.weight_chunk, "weight_cache_max": args.weight_cache_max, **extra})


def _core_args(args, run: RunSpec) -> tuple:
    return (run.mode, run.get("width", args.tree_width), run.get("depth", args.tree_depth), run.get("layers", 1),
            run.get("draft", "async" if getattr(args, "draft_async", False) else "sync") == "async")


def _outcome(group: str, req, real: bool) -> Outcome:
    s = req.stats
    o = Outcome(group, len(req.output_ids), s.pipeline_steps, s.hits, s.verifications, s.rounds,
                prompt_tokens=len(req.prompt_ids), cached_tokens=min(len(req.prompt_ids), s.cached_tokens),
                block_shapes=dict(s.block_shapes), draft_bound_steps=s.draft_bound_steps, draft_calls=s.draft_calls)
    if real:
        summary = req.summary(0)
        o.ttft_ms, o.tbt_ms = summary["ttft_ms"], summary["tbt_ms"]
    return o


def _real(args, runs, stage_counts, prompts, bar) -> list[RunResult]:
    from specpipe.engine.engine import Engine
    from specpipe.engine.observer import NO_OBSERVER
    from specpipe.sampling import SamplingParams

    results = []
    for S in stage_counts:
        engine = Engine(_config(args, S, runs))
        try:
            sampling = SamplingParams(max_tokens=args.max_tokens)
            engine.generate(prompts[0]["text"], SamplingParams(max_tokens=4), mode="pp")  # warm-up
            for run in runs:
                engine.reset_prefix_cache()  # each run starts from the same (empty) cache
                core = engine.core(*_core_args(args, run))
                source = core.source.name if core.source is not None else None
                tracer = _tracer(args, run, S, True, source, [s.end - s.start for s in engine.stage_specs])
                core.observer = tracer or NO_OBSERVER
                res, groups = RunResult(run, S), {}
                t0 = time.perf_counter()
                batches = ([prompts] if args.concurrency > 1 else [[p] for p in prompts])
                for batch in batches:
                    reqs = [engine.prompts.make_request(p["text"], sampling) for p in batch]
                    # Each finished request asks for the stages' reports: they carry the stages'
                    # compute spans into the trace.
                    engine.run(reqs, core, on_finish=lambda _r: (bar.update(), core.request_stage_stats()))
                    res.outcomes += [_outcome(p["group"], r, True) for p, r in zip(batch, reqs)]
                    groups.update({r.request_id: p["group"] for p, r in zip(batch, reqs)})
                res.seconds = time.perf_counter() - t0
                res.trace = _save_trace(args, tracer, run, S, groups)
                core.observer = NO_OBSERVER
                results.append(res)
        finally:
            engine.close()
    return results


def _oracle(args, runs, stage_counts, prompts, bar) -> list[RunResult]:
    from specpipe.config import SPECULATIVE_MODES
    from specpipe.costs.balance import resolve_stage_layers
    from specpipe.engine.core import EngineCore
    from specpipe.engine.engine import Engine
    from specpipe.engine.observer import NO_OBSERVER
    from specpipe.loader.partition import parse_stage_layers, partition_layers
    from specpipe.sampling import SamplingParams
    from specpipe.sim.draft_clock import DraftClock
    from specpipe.sim.oracle_pipeline import OraclePipeline
    from specpipe.spec_decode.async_draft import AsyncDraft

    engine = Engine(_config(args, 1, runs, transport="inproc"))
    L, wanted = engine.checkpoint.config.num_layers, parse_stage_layers(args.stage_layers)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens)
        refs = _references(engine, prompts, sampling, bar)
        results = []
        for S in stage_counts:
            for run in runs:
                reqs = [engine.prompts.make_request(p["text"], sampling) for p in prompts]
                seqs = {r.request_id: r.prompt_ids + ref for r, ref in zip(reqs, refs)}
                by_pid: dict[int, list[int]] = {}
                mode, width, depth, layers, draft_async = _core_args(args, run)
                source = engine.source if mode in SPECULATIVE_MODES else None
                counts = [s.end - s.start for s in partition_layers(
                    L, S, resolve_stage_layers(wanted, engine.cost_profile, L, S, mode, width))]
                pipe = OraclePipeline(S, lambda pid: by_pid.get(pid, []))
                if draft_async and source is not None:  # ready when a modeled clock says so (sim/draft_clock.py)
                    if engine.cost_profile is None:
                        raise ValueError("draft=async under --oracle needs --cost-profile: it says when a "
                                         "draft forward would have finished")
                    source = AsyncDraft(source, clock=DraftClock(engine.cost_profile, counts, pipe))
                core = EngineCore(pipe, mode, source, width=width,
                                  depth=depth, layers=layers, max_num_seqs=max(1, args.concurrency),
                                  step_rows=args.max_step_rows, max_waiting=max(1, len(reqs)),
                                  cost_profile=engine.cost_profile, stage_layers=counts)
                source = core.source.name if core.source is not None else None
                tracer = _tracer(args, run, S, False, source, counts)
                core.observer = tracer or NO_OBSERVER
                res = RunResult(run, S)
                for batch in ([reqs] if args.concurrency > 1 else [[r] for r in reqs]):
                    for r in batch:
                        core.add_request(r)
                    while core.has_work():
                        for st in core.states.values():  # the oracle answers each pipeline id with its sequence
                            by_pid.setdefault(st.pid, seqs[st.req.request_id])
                        bar.update(len(core.step()))
                for p, r, ref in zip(prompts, reqs, refs):
                    if r.output_ids != ref:
                        raise RuntimeError(f"{run.label} at S={S}: request {r.request_id} differs from the "
                                           f"target's own greedy output (a lossless violation)")
                    res.outcomes.append(_outcome(p["group"], r, False))
                res.trace = _save_trace(args, tracer, run, S,
                                        {r.request_id: p["group"] for p, r in zip(prompts, reqs)})
                results.append(res)
    finally:
        engine.close()
    return results


def _references(engine, prompts, sampling, bar) -> list[list[int]]:
    """The target's own greedy outputs, computed for real once and cached (keyed by the model
    file, its size and time, the prompts and max tokens) under ~/.cache/specpipe/bench."""
    import hashlib

    stat = engine.model_path.stat()
    key = json.dumps([str(engine.model_path.resolve()), stat.st_size, stat.st_mtime_ns,
                      [p["text"] for p in prompts], sampling.max_tokens])
    cache = Path.home() / ".cache" / "specpipe" / "bench" / f"refs-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    refs = []
    for i, p in enumerate(prompts):
        bar.set_description(f"reference {i + 1}/{len(prompts)}")
        refs.append(engine.generate(p["text"], sampling, mode="pp").token_ids)
    bar.set_description("")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(refs))
    return refs


# ---- report ------------------------------------------------------------------------------------

def metrics(outcomes: list[Outcome], seconds: float) -> dict:
    tokens, steps = sum(o.tokens for o in outcomes), sum(o.steps for o in outcomes)
    verifications, rounds = sum(o.verifications for o in outcomes), sum(o.rounds for o in outcomes)
    tbt = [o.tbt_ms for o in outcomes if o.tbt_ms is not None]
    ttft = [o.ttft_ms for o in outcomes if o.ttft_ms is not None]
    return {"requests": len(outcomes), "tokens": tokens, "steps": steps,
            "tokens_per_step": tokens / steps if steps else None,
            "hit_rate": sum(o.hits for o in outcomes) / verifications if verifications else None,
            "acceptance_length": tokens / rounds if rounds else None,
            "prefix_cache_hit_rate": (sum(o.cached_tokens for o in outcomes) / prompt
                                      if (prompt := sum(o.prompt_tokens for o in outcomes)) else None),
            "ttft_ms_median": statistics.median(ttft) if ttft else None,
            "tbt_ms_median": statistics.median(tbt) if tbt else None,
            "tbt_ms_p90": percentile(tbt, 90) if tbt else None,
            "throughput_tok_s": tokens / seconds if seconds else None,
            "draft_bound_steps": sum(o.draft_bound_steps for o in outcomes),
            "draft_calls": sum(o.draft_calls for o in outcomes),
            "block_shapes": dict(sorted(sum((collections.Counter(o.block_shapes) for o in outcomes),
                                            collections.Counter()).items())) or None}


def build_report(args, results: list[RunResult]) -> dict:
    real = not args.oracle
    key = "tbt_ms_median" if real else "tokens_per_step"
    runs = []
    for res in results:
        groups = sorted({o.group for o in res.outcomes})
        by_group = {g: metrics([o for o in res.outcomes if o.group == g], 0.0) for g in groups}
        runs.append({"label": res.spec.label, "mode": res.spec.mode, "options": dict(res.spec.options),
                     "stages": res.stages, "concurrency": args.concurrency, "real": real,
                     "all": metrics(res.outcomes, res.seconds), "by_group": by_group,
                     "tbt_ms": [o.tbt_ms for o in res.outcomes if o.tbt_ms is not None], "trace": res.trace})
    for run in runs:  # speed-ups within the same stage count, per group and overall
        same = [r for r in runs if r["stages"] == run["stages"]]
        for part in ["all", *run["by_group"]]:
            mine = run["all"] if part == "all" else run["by_group"][part]
            plain = [r for r in same if r["mode"] == "pp"] or [r for r in same if r["mode"] == "pp-cb"]
            for base, pick in (("pp", plain), ("tree", [r for r in same if r["mode"] == "tree"])):
                vals = [(r["all"] if part == "all" else r["by_group"].get(part, {})).get(key) for r in pick]
                vals = [v for v in vals if v]
                # TBT: lower is better, the best tree is the lowest; tokens per step: higher is better.
                best = (min if real else max)(vals) if vals else None
                mine[f"speedup_vs_{base}"] = (None if not best or not mine.get(key) else
                                             (best / mine[key] if real else mine[key] / best))
    return {"method": "real run" if real else "step count (oracle stages, exact for greedy)",
            "command": "specpipe " + " ".join(sys.argv[1:]) if sys.argv else "", "date": time.strftime("%Y-%m-%d"),
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "runs": runs}


def _cell(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_markdown(report: dict) -> str:
    real = report["method"] == "real run"
    lines = [f"Method: {report['method']}; {report['date']}; up to {report['max_tokens']} greedy tokens per prompt, "
             f"concurrency {report['concurrency']}.", ""]
    groups = ["all"] + sorted({g for r in report["runs"] for g in r["by_group"]})
    head = "| S | run | tok/step | hit rate | accept | " + (
        "prefix hit | TTFT ms | TBT ms | TBT p90 | tok/s | " if real else "")
    head += "vs pp | vs tree |"
    for g in groups:
        lines += [f"**{g}**", "", head, "|" + "---|" * (head.count("|") - 1)]
        for r in report["runs"]:
            m = r["all"] if g == "all" else r["by_group"].get(g)
            if m is None:
                continue
            cells = [str(r["stages"]), r["label"], _cell(m["tokens_per_step"], ".3f"), _cell(m["hit_rate"], ".3f"),
                     _cell(m["acceptance_length"])]
            if real:
                cells += [_cell(m.get("prefix_cache_hit_rate"), ".3f"), _cell(m["ttft_ms_median"], ".0f"),
                          _cell(m["tbt_ms_median"], ".1f"),
                          _cell(m["tbt_ms_p90"], ".1f"), _cell(m["throughput_tok_s"], ".1f")]
            cells += [_cell(m.get("speedup_vs_pp")) + "×", _cell(m.get("speedup_vs_tree")) + "×"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def draw(args, report: dict, results: list[RunResult]) -> None:
    from specpipe.bench import plots

    out = Path(args.plots)
    out.mkdir(parents=True, exist_ok=True)
    if report["runs"][0]["real"]:
        plots.tbt_distributions([{"label": f"{r['label']} S={r['stages']}", "tbt_ms": r["tbt_ms"]}
                                 for r in report["runs"] if r["tbt_ms"]], out / "tbt.png")
    plots.tokens_per_step_vs_stages([{"label": r["label"], "stages": r["stages"],
                                      "tokens_per_step": r["all"]["tokens_per_step"]} for r in report["runs"]],
                                    out / "tokens_per_step.png")
    if report["runs"][0]["real"] or args.profile:  # real runs: the stages' own times; oracle: simulated
        from specpipe.costs.profile import load_profile
        from specpipe.sim.trace import Trace

        profile = load_profile(args.profile) if args.profile else None
        for S in sorted({r.stages for r in results}):
            traces = [(r.spec.label, Trace.load(r.trace)) for r in results if r.stages == S and r.trace]
            panels = [(label, t.only(min(t.requests))) for label, t in traces]  # the first prompt
            model_draft = any(t.meta.get("source") not in ("ngram", "none") for _, t in panels)
            plots.timeline(panels, profile, out / f"timeline_s{S}.png", draft_cost=model_draft)
    print(f"pictures in {out}", file=sys.stderr)

