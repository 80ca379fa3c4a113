"""Pictures of benchmark results (PNG): the pipeline timeline that explains SpecPipe, TBT
distributions, and tokens per step against the number of stages.

The timeline draws what each stage computed at each step (the trace, sim/trace.py) at the times
the event simulator (sim/events.py) gives it on a cost profile: real runs record when the driver
sent and collected a step, not when each stage computed, so the stage times are always simulated.

matplotlib is imported inside the functions, so that `import specpipe` stays fast, and figures
are built with `matplotlib.figure.Figure` rather than pyplot: that draws with Agg, needs no
display and leaves the caller's pyplot backend and global state alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Optional

from specpipe.costs.profile import NO_LINK, CostProfile, Link
from specpipe.sim.events import SimResult, has_stage_spans, measured, simulate
from specpipe.sim.trace import Trace

DPI = 120
BOX = 0.8  # height of a stage's box, in stage rows
UNKNOWN = -1  # request of rows a trace without `work` (an older file) cannot attribute


class Box(NamedTuple):
    """What one stage computed at one step, and when (simulated)."""

    step: int
    stage: int  # 0-based
    start: float  # ms
    end: float
    parts: list[tuple[int, int, float, float]]  # (request, depth, share of the rows, share pruned later)


def _boxes(trace: Trace, sim: SimResult) -> list[Box]:
    """One box per (step, stage) that computed rows, split by the step's `work` groups. Shares are
    fractions of the box's rows: the parts' shares sum to 1, their pruned shares to pruned/rows."""
    if len(sim.spans) != len(trace.steps):
        raise ValueError("the simulation has no spans for this trace (simulate with keep_spans=True)")
    boxes = []
    for k, (step, spans) in enumerate(zip(trace.steps, sim.spans)):
        for s, rows in enumerate(step.rows):
            if rows <= 0:
                continue
            groups = step.work[s] if s < len(step.work) and step.work[s] else [[UNKNOWN, 0, rows, 0]]
            total = sum(g[2] for g in groups)
            parts = [(rid, depth, n / total, pruned / total) for rid, depth, n, pruned in groups]
            boxes.append(Box(k, s, spans[s][0], spans[s][1], parts))
    return boxes


def _shade(rgb, depth: int):
    """Deeper in the tree = mixed further towards white (depth 0 is the request's full colour)."""
    light = min(0.8, 0.2 * depth)
    return tuple(c + (1.0 - c) * light for c in rgb[:3])


def _save(fig, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def timeline(panels: list[tuple[str, Trace]], profile: Optional[CostProfile], out: Path, *, link: Link = NO_LINK,
             driver_ms: float = 0.0, max_ms: float | None = None, stage_layers: Sequence[int] | None = None,
             draft_cost: bool = True) -> Path:
    """One panel per (label, trace), sharing the time axis: a box per stage and step, coloured by
    request, lighter deeper in the tree, hatched for rows pruned later; ▲ where tokens were
    committed. A real run's trace with the stages' own compute spans is drawn as measured (from
    its first step); any other is simulated on `profile`. `max_ms` crops the time axis (default:
    the shortest panel's run, so that every panel shows the same time). Arguments after `out` are
    those of events.simulate."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("timeline needs at least one (label, trace) panel")
    sims = []
    for label, trace in panels:
        if not trace.steps:
            raise ValueError(f"panel {label!r}: the trace has no steps")
        if has_stage_spans(trace):
            sim, kind = measured(trace, origin_s=trace.steps[0].t_submit), "measured"
        elif profile is None:
            raise ValueError(f"panel {label!r}: the trace has no measured stage spans; a profile is needed "
                             "to simulate them")
        else:
            sim, kind = simulate(trace, profile, stage_layers, link, driver_ms, draft_cost, keep_spans=True), "simulated"
        boxes = _boxes(trace, sim)
        if not boxes:
            raise ValueError(f"panel {label!r}: no stage computed any rows")
        sims.append((sim, boxes, kind))
    kinds = {kind for _, _, kind in sims}
    max_ms = min(sim.total_ms for sim, _, _ in sims) if max_ms is None else max_ms
    if not max_ms > 0:
        raise ValueError(f"nothing to draw in the first {max_ms} ms")

    # The same request keeps its colour in every panel (the panels usually run the same prompts).
    rids = sorted({p[0] for _, boxes, _ in sims for b in boxes for p in b.parts} - {UNKNOWN})
    colour = {rid: colormaps["tab10"](i % 10) for i, rid in enumerate(rids)} | {UNKNOWN: (0.5, 0.5, 0.5)}

    heights = [0.45 * t.num_stages + 1.1 for _, t in panels]
    fig = Figure(figsize=(13, sum(heights) + 1.0), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (label, trace), (sim, boxes, kind) in zip(axes, panels, sims):
        S = trace.num_stages
        # Rectangles as (x, width, bottom, height[, colour]), drawn with one bar() call per kind.
        fills, hatches, outlines = [], [], []
        for b in boxes:
            if b.start >= max_ms:
                continue
            x, w, top = b.start, b.end - b.start, S - 1 - b.stage + BOX / 2  # stage 1 at the top
            outlines.append((x, w, top - BOX, BOX))
            for rid, depth, share, pruned in b.parts:  # parts stacked downwards, pruned rows at their foot
                top -= share * BOX
                fills.append((x, w, top, share * BOX, _shade(colour[rid], depth)))
                if pruned:
                    hatches.append((x, w, top, pruned * BOX))
        for rects, style in [(fills, {"linewidth": 0}),
                             (hatches, {"fill": False, "hatch": "///", "edgecolor": "0.25", "linewidth": 0}),
                             (outlines, {"fill": False, "edgecolor": "black", "linewidth": 0.6})]:
            if rects:
                x, w, y, h, *c = zip(*rects)
                ax.bar(x, h, w, y, align="edge", **({"color": c[0]} if c else {}), **style)

        # Tokens committed: a ▲ per collect time, in the request's colour (black when several
        # requests commit together), with the count when more than one token is committed.
        commits: dict[float, list[int]] = {}
        for rid, times in sim.token_times.items():
            for t in times:
                commits.setdefault(t, []).append(rid)
        marks: dict[int | None, list[float]] = {}  # request (None: several) -> times
        for t, who in commits.items():
            if t <= max_ms:
                marks.setdefault(who[0] if len(set(who)) == 1 else None, []).append(t)
                if len(who) > 1:
                    ax.annotate(str(len(who)), (t, -0.75), xytext=(3, 2), textcoords="offset points", fontsize=6)
        for rid, times in marks.items():
            ax.plot(times, [-0.75] * len(times), "^", color="black" if rid is None else colour[rid], markersize=5)

        tbt = sim.tbt_ms()
        tbt_text = f"median TBT {statistics.median(tbt):.1f} ms" if tbt else "TBT n/a"
        ax.set_title(f"{label}: {sim.tokens} tokens in {sim.steps} steps ({sim.tokens / sim.steps:.2f} tokens/step), "
                     f"{kind} {tbt_text}", fontsize=9, loc="left")
        ax.set_yticks(range(S), [f"stage {S - i}" for i in range(S)], fontsize=8)
        ax.set_ylim(-1.1, S - 0.5)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, max_ms)
    axes[-1].set_xlabel(f"time (ms, {' / '.join(sorted(kinds))})")

    if "simulated" in kinds:
        extras = f", link {link.name}" if link != NO_LINK else ""
        extras += f", driver {driver_ms:g} ms/step" if driver_ms else ""
        title = (f"Stage times simulated from the recorded traces with profile {profile.device!r} "
                 f"({profile.method}{extras})")
        if "measured" in kinds:
            title += "; panels marked measured: as the stages timed themselves"
    else:
        title = "Stage times as the stages timed themselves (a real run)"
    fig.suptitle(title, fontsize=10)
    handles = [Patch(color=colour[rid], label=f"request {rid}") for rid in rids[:10]]
    if any(p[0] == UNKNOWN for _, boxes, _ in sims for b in boxes for p in b.parts):
        handles.append(Patch(color=colour[UNKNOWN], label="request not recorded"))
    depths = ["depth 0 (committed, prompt, root)", "depth 1", "depth 2", "depth 3", "depth 4+"]
    handles += [Patch(color=_shade((0.3, 0.3, 0.3), d), label=text) for d, text in enumerate(depths)]
    handles += [Patch(facecolor="white", edgecolor="0.25", hatch="///", label="pruned later (wasted)"),
                Line2D([], [], marker="^", linestyle="none", color="black", label="tokens committed (number if > 1)")]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    return _save(fig, out)


def tbt_distributions(runs: list[dict], out: Path) -> Path:
    """A box per run ({"label", "tbt_ms": per-request TBT}), with every request as a point."""
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("tbt_distributions needs at least one run")
    for run in runs:
        if not run.get("tbt_ms"):
            raise ValueError(f"run {run.get('label')!r} has no TBT values (a request needs two tokens)")
    fig = Figure(figsize=(max(5.0, 1.6 * len(runs) + 2), 5), layout="constrained")
    ax = fig.subplots()
    data = [list(run["tbt_ms"]) for run in runs]
    ax.boxplot(data, showfliers=False)  # the points below show the outliers
    for i, values in enumerate(data, start=1):
        # Evenly spread, not random: the same data draws the same picture.
        offsets = [0.0] if len(values) == 1 else [-0.15 + 0.3 * j / (len(values) - 1) for j in range(len(values))]
        ax.plot([i + o for o in offsets], values, ".", color="tab:blue", alpha=0.6)
    ax.set_xticks(range(1, len(runs) + 1), [f"{r['label']}\n(n={len(r['tbt_ms'])})" for r in runs], fontsize=8)
    ax.set_ylabel("TBT per request (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Time between tokens")
    return _save(fig, out)


def tokens_per_step_vs_stages(runs: list[dict], out: Path) -> Path:
    """A line per label ({"label", "stages", "tokens_per_step"}) against S, with the ideal of one
    token per step and pp's 1/S for context."""
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("tokens_per_step_vs_stages needs at least one run")
    series: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        missing = {"label", "stages", "tokens_per_step"} - run.keys()
        if missing:
            raise ValueError(f"run {run} lacks {sorted(missing)}")
        if int(run["stages"]) < 1:
            raise ValueError(f"run {run['label']!r} has {run['stages']} stages")
        series.setdefault(str(run["label"]), []).append((int(run["stages"]), float(run["tokens_per_step"])))
    stages = sorted({s for points in series.values() for s, _ in points})
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    lo, hi = stages[0], stages[-1]
    xs = [lo + (hi - lo) * i / 50 for i in range(51)] if hi > lo else [lo - 0.2, lo + 0.2]
    ax.axhline(1.0, color="grey", linestyle=":", label="1 token/step")
    ax.plot(xs, [1 / x for x in xs], "k--", linewidth=1, label="pp: 1/S")
    for label, points in series.items():
        points.sort()
        ax.plot([s for s, _ in points], [t for _, t in points], "o-", label=label)
    ax.set_xticks(stages)
    ax.set_xlabel("pipeline stages S")
    ax.set_ylabel("tokens per pipeline step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Tokens per pipeline step")
    return _save(fig, out)
