"""`--layers-per-step auto`: how deep and how wide the next block of a request's tree should be
(docs/design.md §4, "Several layers per step"), from what the target has accepted so far and what rows cost.

A block of d layers of w nodes enters stage 1 each step. With a hit rate h (the share of the
target's tokens the tree held), a step that verifies a block commits tokens until the first miss:
1 + h + ... + h^(d-1) of them on average, and ends in a miss with probability 1 - h^d; a miss
costs S - 1 steps of refill (the new root must cross every stage). So, in tokens per step,

    E(h, d, S) = (1 + h + ... + h^(d-1)) / (1 + (1 - h^d) (S - 1))

(d = 1: 1 / (1 + (1 - h)(S - 1)); h = 1: d). Width sets the hit rate: the target's token must be
among the w children the tree holds. The source ranks its proposals, so the hit rate at any width
up to the proposals' count follows from where the target's tokens ranked (HitProfile).

A step costs the slowest of: the stages, each computing about the rows of one block per step
(d x w), and the drafting, d source forwards one after another while the stages compute. The
plan is the (d, w) with the most tokens per millisecond, E / step time.

For a source that runs a model, with a cost profile, d = 0 competes too: no drafting, pp's one
token per pass of one row through every stage in turn (a draft that costs more than its hits
save, as a small model on a CPU can, makes that the plan). A request that takes it stops drafting
for good, so until the hit profile holds STOP_EVIDENCE verifications it is taken only where
drafting would lose even if every token hit. Not for a source that costs nothing (n-gram): there
only the stages' rows weigh against pp, and the step time above overstates them (every stage is
priced for the whole block, though verifications prune it on its way down the pipeline).

Without a cost profile every shape costs the same (rows nearly free, drafting hidden: an accelerator far from its
compute bound) and the deepest, widest block wins; the engine still backs off a layer whenever
drafting measurably outlasts the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from specpipe.costs.profile import CostProfile

PRIOR_VERIFICATIONS = 8  # the hit profile starts as this many verifications at PRIOR_HIT_RATE
PRIOR_HIT_RATE = 0.8
CONTEXT_STEP = 256  # step costs are looked up for contexts rounded up to this many tokens
STOP_EVIDENCE = 64  # verifications measured before a hit rate may decide against drafting


def expected_tokens_per_step(h: float, d: int, num_stages: int) -> float:
    """E(h, d, S) above."""
    committed = sum(h ** j for j in range(d))
    return committed / (1.0 + (1.0 - h ** d) * (num_stages - 1))


@dataclass
class HitProfile:
    """Where the target's tokens ranked among the source's proposals for their parent, over all
    verifications of the requests that share it (one per engine core: a draft's strength is a
    property of the pair, not of one request)."""

    max_width: int
    ranks: list[int] = field(default_factory=list)  # ranks[r]: target tokens at rank r (0 = best)
    verifications: int = 0  # all of them, also those whose token was not proposed
    hits: int = 0  # ... and those the tree held

    def __post_init__(self) -> None:
        self.ranks = self.ranks or [0] * self.max_width

    def record(self, rank: Optional[int], hit: bool) -> None:
        """`rank`: the target token's rank among the proposals, None if it was not proposed."""
        self.verifications += 1
        self.hits += hit
        if rank is not None and rank < self.max_width:
            self.ranks[rank] += 1

    def hit_rate(self, width: int, used_width: int) -> float:
        """The hit rate a tree of `width` children per layer would have, from the measured one at
        `used_width`: the tree holds fewer children of the right parent than the source proposed
        (a layer's width is shared by several parents), so the measured rate is scaled by how the
        proposals' reach changes with width. A prior of PRIOR_VERIFICATIONS at PRIOR_HIT_RATE keeps
        the first steps sane."""
        n = self.verifications + PRIOR_VERIFICATIONS
        measured = (self.hits + PRIOR_HIT_RATE * PRIOR_VERIFICATIONS) / n
        reach = [(sum(self.ranks[:w]) + PRIOR_HIT_RATE * PRIOR_VERIFICATIONS) / n for w in (width, used_width)]
        return min(1.0, measured * reach[0] / reach[1]) if reach[1] > 0 else measured


class StepCost:
    """The time of one pipeline step when each stage computes `rows` rows and the source makes
    `forwards` forwards of `draft_rows` rows while they compute: the slowest of the two. From a
    cost profile (`specpipe profile`, or a roofline preset), with the profile's layers split over
    `num_stages` stages as `stage_layers` says (default: the even split); the slowest stage is the
    one that counts. `draft_cost` False: the source runs no model (n-gram lookup) and its forwards
    cost nothing, whatever draft the profile holds."""

    def __init__(self, profile: "CostProfile", num_stages: int, draft_cost: bool = True,
                 stage_layers: Optional[Sequence[int]] = None) -> None:
        from specpipe.loader.partition import partition_layers

        if not profile.num_layers:
            raise ValueError("the cost profile does not say how many layers its model has")
        self.profile, self.draft_cost = profile, draft_cost
        self.layers = [p.end - p.start for p in partition_layers(profile.num_layers, num_stages, stage_layers)]
        self._ms: dict[tuple[int, int, int, int], float] = {}  # every request plans every step: remember

    def _stages_ms(self, rows: int, context: int) -> list[float]:
        """Each stage's time for `rows` rows at a rounded context."""
        S = len(self.layers)
        return [self.profile.stage(n, s == S - 1, rows, context) for s, n in enumerate(self.layers)]

    def pass_ms(self, context: int) -> float:
        """One row through every stage, one after another: what a token costs without drafting."""
        return sum(self._stages_ms(1, _rounded(context)))

    def step_ms(self, rows: int, forwards: int, draft_rows: int, context: int) -> float:
        context = _rounded(context)
        key = (rows, forwards, draft_rows, context)
        if key not in self._ms:
            drafting = forwards * self.profile.draft_forward(draft_rows, context) if self.draft_cost else 0.0
            self._ms[key] = max(max(self._stages_ms(rows, context)), drafting)
        return self._ms[key]


def _rounded(context: int) -> int:
    """Step costs are looked up for contexts rounded up to CONTEXT_STEP tokens."""
    return -(-max(context, 1) // CONTEXT_STEP) * CONTEXT_STEP


def plan_block(hits: HitProfile, used_width: int, num_stages: int, max_layers: int, widths: Sequence[int],
               cost: Optional[StepCost], context: int) -> tuple[int, int]:
    """The (layers, width) with the most expected tokens per unit of step time; layers 0: do not
    draft (only for a model source priced by a cost profile, where strictly faster)."""
    best, best_rate, best_hoped = (1, max(widths)), -1.0, -1.0
    for w in sorted(set(widths)):
        h = hits.hit_rate(w, used_width)
        for d in range(1, max_layers + 1):
            ms = cost.step_ms(d * w, d, w, context) if cost is not None else 1.0
            rate = expected_tokens_per_step(h, d, num_stages) / ms if ms > 0 else float("inf")
            if rate > best_rate * (1 + 1e-9):  # ties: the smaller block (fewer rows, fewer forwards)
                best, best_rate = (d, w), rate
            best_hoped = max(best_hoped, d / ms if ms > 0 else float("inf"))  # every token hit: d a step
    if cost is not None and cost.draft_cost:
        against = best_rate if hits.verifications >= STOP_EVIDENCE else best_hoped
        if 1.0 / cost.pass_ms(context) > against * (1 + 1e-9):
            return 0, max(widths)
    return best
