"""Cost profiles: what one pipeline stage, the LM head and the draft source cost on one device, as
a function of the rows computed in a step and the context they attend to (docs/design.md §10).

A profile is measured (`specpipe profile`, costs/measure.py) or derived from a device's published
specifications (costs/roofline.py). Both write the same JSON file:

  {"format": "specpipe-profile/1", "device": ..., "method": "measured" | "roofline",
   "model": {...}, "draft": {...} | null, "assumptions": [...],
   "rows": [1, 2, 4, ...], "contexts": [256, 1024, ...],
   "layer_ms": [[...] per context],   one target decoder layer, rows x context
   "head_ms":  [...],                 final norm + LM head of the target, per rows
   "draft_ms": [[...] per context],   one whole forward of the draft source ([] if none)
   "overhead_ms": [...],              a stage's step beyond its layers (masks, slots, packing,
                                      messages to and from the model), per rows; [] = none
   "request_ms": [...],               per context: what each request beyond the first adds to a
                                      layer (its own context read, its attention segment)
   "request_overhead_ms": ...,        ... and to a stage's step outside the layers
   "stage_layers": K,                 the middle stage layer_ms was measured on (0: not recorded)
   "layer_ms_by_stage": {"M": [[...] per context]},  the same layer measured on larger middle
                                      stages of M layers ({} = none; `specpipe profile
                                      --stage-layers K,M`)
   "head_ms_by_stage": {"M": [...]},  the head measured on last stages of M layers, per rows ({} =
                                      only head_ms, measured on a last stage of 1 layer)
   "idle_gaps_ms": [0, 2, 5, ...],    what a stage's step costs more after the stage idled this
   "idle_layer_ms": {"M": [...]},     long since its previous step, per layer of a stage of M
   "idle_head_ms": [...],             layers and for the head, per gap ([] / {} = not measured)
   "contention": 1.0,                 a step's cost on this device while other work shares its
                                      cores, relative to the idle measurement above (1.0: idle;
                                      benchmarks/bench_contention.py measures it, `with_contention`
                                      sets it): stage() and draft_forward() are multiplied by it
   "experts_read": [...],             a mixture of experts: the distinct experts one sparse layer's
                                      step of n rows ran, per rows (mean over the measured steps;
                                      [] = a dense model); layer_ms is then that sparse layer's
   "row_bytes": ...,                  bytes of one row's hidden state on the link between stages
   "links": {name: {...}}}            links measured with the profile (e.g. loopback-s2: stage
                                      processes on this machine), usable by name in `specpipe sim`

Between measured points costs are linear in rows and in context; past the last measured row
count or context they are extrapolated from the last two points (compute-bound growth; never below
the last point), below the first they are the first point (a step never costs less than its fixed
overhead). Where layer_ms_by_stage has tables, a stage's layers cost what its own size reads off
them, linear between the measured sizes and flat outside them: a stage whose weights and KV
outgrow the caches streams them from memory, and its layers cost more than a small stage's;
head_ms_by_stage does the same for the head.
The idle tables say the same in time: on a machine whose caches others share, what a stage left
there fades while it waits for the rest of the pipeline, so a step after an idle gap reads more
from memory (docs/benchmarks.md §4.4); linear between the measured gaps, flat past the last.
Files written before contexts were added ({"profile": {"rows", "layer_ms", "head_ms",
"draft_ms", "context"}}) load as one context.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

FORMAT = "specpipe-profile/1"
PROFILES_DIR = Path(__file__).parent / "profiles"  # shipped profiles (costs/roofline.py writes them)


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear in x; flat below the first point, extrapolated past the last (never
    downwards: more rows or context never cost less, whatever the noise in the last two points)."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if x > x1:
        return max(float(y1), y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class CostProfile:
    """Milliseconds per step on one device; see the module docstring for the file format."""

    device: str
    rows: list[int]
    layer_ms: list[list[float]]  # [context][rows]
    head_ms: list[float]  # [rows]
    draft_ms: list[list[float]] = field(default_factory=list)  # [context][rows]; [] without a draft
    contexts: list[int] = field(default_factory=lambda: [256])
    method: str = "measured"
    model: dict[str, Any] = field(default_factory=dict)  # name, num_layers, hidden_size, ...
    draft: Optional[dict[str, Any]] = None
    assumptions: list[str] = field(default_factory=list)
    row_bytes: int = 0
    overhead_ms: list[float] = field(default_factory=list)  # [rows]
    links: dict[str, dict] = field(default_factory=dict)  # name -> Link fields
    request_ms: list[float] = field(default_factory=list)  # [context]
    request_overhead_ms: float = 0.0
    stage_layers: int = 0
    layer_ms_by_stage: dict[str, list[list[float]]] = field(default_factory=dict)  # layers -> [context][rows]
    head_ms_by_stage: dict[str, list[float]] = field(default_factory=dict)  # layers -> [rows]
    idle_gaps_ms: list[float] = field(default_factory=list)
    idle_layer_ms: dict[str, list[float]] = field(default_factory=dict)  # layers -> [gap]
    idle_head_ms: list[float] = field(default_factory=list)  # [gap]
    contention: float = 1.0  # measured cost under other work / idle cost; multiplies stage() and draft_forward()
    experts_read: list[float] = field(default_factory=list)  # [rows]: distinct experts a sparse layer's step read

    def __post_init__(self) -> None:
        if not self.contention > 0:
            raise ValueError(f"profile contention must be a positive factor, got {self.contention}")
        if list(self.rows) != sorted(set(self.rows)) or not self.rows or self.rows[0] < 1:
            raise ValueError(f"profile rows must be ascending positive counts, got {self.rows}")
        if list(self.contexts) != sorted(set(self.contexts)) or not self.contexts:
            raise ValueError(f"profile contexts must be ascending, got {self.contexts}")
        tables = {"layer_ms": self.layer_ms, **({"draft_ms": self.draft_ms} if self.draft_ms else {}),
                  **{f"layer_ms_by_stage[{k}]": t for k, t in self.layer_ms_by_stage.items()}}
        if self.layer_ms_by_stage and (self.stage_layers < 1 or any(int(k) <= self.stage_layers
                                                                    for k in self.layer_ms_by_stage)):
            raise ValueError(f"profile layer_ms_by_stage must be for stages larger than stage_layers "
                             f"({self.stage_layers}), got {sorted(self.layer_ms_by_stage)}")
        for name, table in tables.items():
            if len(table) != len(self.contexts) or any(len(r) != len(self.rows) for r in table):
                raise ValueError(f"profile {name} must be {len(self.contexts)} contexts x {len(self.rows)} rows")
        for name, values in {"head_ms": self.head_ms, **({"overhead_ms": self.overhead_ms} if self.overhead_ms else {}),
                             **{f"head_ms_by_stage[{k}]": v for k, v in self.head_ms_by_stage.items()}}.items():
            if len(values) != len(self.rows):
                raise ValueError(f"profile {name} must have {len(self.rows)} entries")
        if self.experts_read and len(self.experts_read) != len(self.rows):
            raise ValueError(f"profile experts_read must have {len(self.rows)} entries")
        if self.request_ms and len(self.request_ms) != len(self.contexts):
            raise ValueError(f"profile request_ms must have {len(self.contexts)} entries")
        gaps = self.idle_gaps_ms
        if list(gaps) != sorted(set(gaps)) or (gaps and gaps[0] < 0):
            raise ValueError(f"profile idle_gaps_ms must be ascending and non-negative, got {gaps}")
        for name, table in {"idle_head_ms": self.idle_head_ms,
                            **{f"idle_layer_ms[{k}]": t for k, t in self.idle_layer_ms.items()}}.items():
            if (table or gaps) and len(table) != len(gaps):
                raise ValueError(f"profile {name} must have one entry per idle gap ({len(gaps)})")

    @property
    def num_layers(self) -> int:
        return int(self.model.get("num_layers", 0))

    def _table(self, table: list[list[float]], n: int, context: Optional[int]) -> float:
        if n <= 0 or not table:
            return 0.0
        per_context = [_interp(self.rows, row, n) for row in table]
        ctx = self.contexts[0] if context is None else context
        return _interp(self.contexts, per_context, ctx)

    def layer(self, n: int, context: Optional[int] = None, stage_layers: Optional[int] = None) -> float:
        """One decoder layer for n rows at `context`, in a stage of `stage_layers` layers (None:
        the stage layer_ms was measured on)."""
        base = self._table(self.layer_ms, n, context)
        if not self.layer_ms_by_stage or stage_layers is None or stage_layers <= self.stage_layers:
            return base
        sizes = [self.stage_layers, *sorted(int(k) for k in self.layer_ms_by_stage)]
        costs = [base, *(self._table(self.layer_ms_by_stage[str(k)], n, context) for k in sizes[1:])]
        return _interp(sizes, costs, min(stage_layers, sizes[-1]))

    def idle(self, layers: int, last: bool, gap_ms: float) -> float:
        """What a step of a stage of `layers` layers (with the head if `last`) costs more when the
        stage idled `gap_ms` since its previous step than when it ran back to back (0 where the
        profile has no idle tables)."""
        if not self.idle_gaps_ms or gap_ms <= 0:
            return 0.0

        def at_gap(values: Sequence[float]) -> float:
            return _interp(self.idle_gaps_ms, values, min(gap_ms, self.idle_gaps_ms[-1]))

        extra = at_gap(self.idle_head_ms) if last and self.idle_head_ms else 0.0
        if self.idle_layer_ms and layers > 0:
            sizes = sorted(int(k) for k in self.idle_layer_ms)
            per_layer = [at_gap(self.idle_layer_ms[str(k)]) for k in sizes]
            extra += layers * _interp(sizes, per_layer, min(layers, sizes[-1]))
        return extra

    def head(self, n: int, stage_layers: Optional[int] = None) -> float:
        """The final norm and LM head for n rows, on a last stage of `stage_layers` layers (None:
        the 1-layer last stage head_ms was measured on)."""
        if n <= 0:
            return 0.0
        base = _interp(self.rows, self.head_ms, n)
        if not self.head_ms_by_stage or stage_layers is None or stage_layers <= 1:
            return base
        sizes = [1, *sorted(int(k) for k in self.head_ms_by_stage)]
        costs = [base, *(_interp(self.rows, self.head_ms_by_stage[str(k)], n) for k in sizes[1:])]
        return _interp(sizes, costs, min(stage_layers, sizes[-1]))

    def draft_forward(self, n: int, context: Optional[int] = None) -> float:
        return self._table(self.draft_ms, n, context) * self.contention

    def with_contention(self, factor: float) -> "CostProfile":
        """This profile on a device whose other work makes every step `factor` times the idle
        cost (e.g. decode's ms a token under a load over its ms idle, bench_contention.py)."""
        return replace(self, contention=float(factor))

    def stage(self, layers: int, last: bool, n: int, context: Optional[int] = None,
              others: Sequence[int] = (), head: Optional[int] = None) -> float:
        """One stage of `layers` decoder layers (plus the head on the last stage, for `head` of
        the rows, default all) for n rows: of one request at `context`, plus one more request for
        each context in `others`."""
        if n <= 0:
            return 0.0
        overhead = _interp(self.rows, self.overhead_ms, n) if self.overhead_ms else 0.0
        if self.request_ms:
            overhead += sum(layers * _interp(self.contexts, self.request_ms, c) + self.request_overhead_ms
                            for c in others)
        head_ms = self.head(n if head is None else head, layers) if last else 0.0
        return (layers * self.layer(n, context, layers) + head_ms + overhead) * self.contention

    # ---- files ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: dict) -> "CostProfile":
        if data.get("format") == FORMAT:
            return cls(**{k: v for k, v in data.items() if k != "format"})
        if "profile" in data:  # single-context files written before `specpipe profile` existed
            p = data["profile"]
            return cls(device=p["device"], rows=p["rows"], layer_ms=[p["layer_ms"]], head_ms=p["head_ms"],
                       draft_ms=[p["draft_ms"]] if p.get("draft_ms") else [], contexts=[p.get("context") or 256],
                       model={"path": data.get("target"), "num_layers": data.get("num_layers", 0)},
                       draft={"path": data["draft"]} if data.get("draft") else None)
        raise ValueError(f"not a SpecPipe cost profile (format {data.get('format')!r})")

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        return cls.from_json(read_json(path, "profile"))


def load_profile(name: str | Path) -> CostProfile:
    """A profile file, or a shipped profile by (the start of) its name: a100-80gb, h100-80gb, ..."""
    if Path(name).is_file():
        return CostProfile.load(name)
    shipped = sorted(PROFILES_DIR.glob(f"{name}*.json"))
    if len(shipped) == 1:
        return CostProfile.load(shipped[0])
    known = ", ".join(p.stem for p in sorted(PROFILES_DIR.glob("*.json")))
    raise ValueError(f"no profile file {name!r} and no single shipped profile starting with it; shipped: {known}")


def read_json(path: str | Path, what: str) -> dict:
    """A JSON file, or a ValueError that says which file and why."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from None


@dataclass(frozen=True)
class Link:
    """A link between two consecutive stages (and between the driver and a stage): a message of
    b bytes arrives latency_ms + b / bandwidth after it is sent."""

    name: str
    latency_ms: float
    gbytes_per_s: float  # 10^9 bytes per second, one direction

    def transfer_ms(self, nbytes: int) -> float:
        return self.latency_ms + (nbytes / (self.gbytes_per_s * 1e6) if self.gbytes_per_s > 0 else 0.0)


NO_LINK = Link("none", 0.0, 0.0)
