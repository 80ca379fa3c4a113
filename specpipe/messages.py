"""The messages that cross between the driver and the stages: small typed dataclasses.

Exactly three kinds travel, one of each per link per pipeline step (an empty one when there is
nothing to say), which keeps every link in lock-step and the pipeline free of deadlocks:

  Control   driver -> every stage   what to commit, prune, admit or release before computing, and
                                     which blocks join or leave the prefix cache
  Rows      driver -> stage 1, stage s -> stage s+1 (and stage S -> driver as `Results`)
  Results   stage S -> driver        the target's token for each surviving row (and its
                                     log-probabilities, for a request that asked)

Control data are plain lists of ints; only the activations are a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional, Protocol

import torch

from specpipe.sampling import SamplingParams, TokenLogprobs

NO_PARENT = -1  # parent id of a request's very first token

@dataclass
class Admit:
    """A new request enters the stages; the last stage needs its sampling parameters."""

    request_id: int
    sampling: SamplingParams
    cached: list[int] = field(default_factory=list)  # cache ids of the blocks holding its first positions


@dataclass
class Share:
    """Prefix caching: one request's block-aligned runs of committed positions join the cache,
    run blocks[i] (positions blocks[i]*B ..) under cache id ids[i] (kv/slot_table.py, `share`)."""

    request_id: int
    blocks: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


@dataclass
class Prune:
    """Pruning propagation for one request (docs/design.md §4, phase 2)."""

    request_id: int
    commit: list[int] = field(default_factory=list)  # node ids joining the committed prefix, in order
    drop: list[int] = field(default_factory=list)  # node ids whose subtrees are pruned


@dataclass
class Control:
    admit: list[Admit] = field(default_factory=list)
    prune: list[Prune] = field(default_factory=list)
    release: list[int] = field(default_factory=list)  # finished request ids: free all their KV
    share: list[Share] = field(default_factory=list)  # blocks that join the prefix cache (before release)
    evict: list[int] = field(default_factory=list)  # cache ids to forget (after release, before admit)
    report: bool = False  # every stage sends its cumulative StageStats to the driver
    shutdown: bool = False


@dataclass
class Rows:
    """Tree nodes (or prompt/decode tokens) of one request travelling down the pipeline.

    Parents precede their children within a message; every parent is either committed or a node
    that this stage has already computed (the pipeline is FIFO, so ancestors always arrive first).

    `failed`: a marker with no rows saying that a stage ran out of KV for this request and dropped
    it; every later stage drops the request too and passes the marker on (see `Results.failed`).
    """

    request_id: int
    node_ids: list[int]  # (T,)
    parent_ids: list[int]  # (T,) NO_PARENT only for the first prompt token
    positions: list[int]  # (T,) absolute positions
    data: torch.Tensor  # (T,) token ids into stage 1, (T, H) hidden states after
    head_rows: Optional[list[int]] = None  # rows whose target token is wanted; None = all
    failed: bool = False  # no rows: the request ran out of KV at an earlier stage
    # Structured output: one token mask per head row, in head-row order ((H, W) int64 bits,
    # specpipe/grammar/bitmask.py); the last stage masks the target's logits with it. None: free.
    masks: Optional[torch.Tensor] = None
    # Penalties (specpipe/penalties.py): the committed context's distinct tokens with their counts
    # ((2, P) int64) and each head row's tokens below it, in head-row order ((H, D) int64, -1
    # padded); the last stage penalizes each row's logits over its own path. None: no penalties.
    seen: Optional[torch.Tensor] = None
    paths: Optional[torch.Tensor] = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): for each head row, the token whose
    # log-probability the last stage returns there (the next prompt token), or -1: the target's
    # own token, as for any row. None: the target's token at every head row.
    scored: Optional[list[int]] = None

    @staticmethod
    def failure(request_id: int) -> "Rows":
        return Rows(request_id, [], [], [], torch.empty(0, dtype=torch.long), failed=True)

    def __len__(self) -> int:
        return len(self.node_ids)

    def select(self, keep: list[int]) -> "Rows":
        """Only the rows at indices `keep` (pruned rows are dropped before they are sent on)."""
        if len(keep) == len(self.node_ids):
            return self
        idx = torch.tensor(keep, dtype=torch.long, device=self.data.device)
        wanted = None if self.head_rows is None else set(self.head_rows)
        heads = self.head_rows if self.head_rows is not None else range(len(self.node_ids))
        kept = set(keep)
        staying = [j for j, h in enumerate(heads) if h in kept]  # the head rows that stay
        masks = None if self.masks is None else self.masks[staying]
        paths = None if self.paths is None else self.paths[staying]
        scored = None if self.scored is None else [self.scored[j] for j in staying]
        return Rows(
            request_id=self.request_id,
            node_ids=[self.node_ids[i] for i in keep],
            parent_ids=[self.parent_ids[i] for i in keep],
            positions=[self.positions[i] for i in keep],
            data=self.data.index_select(0, idx),
            head_rows=None if wanted is None else [j for j, i in enumerate(keep) if i in wanted],
            masks=masks,
            seen=self.seen,
            paths=paths,
            scored=scored,
        )


@dataclass
class Results:
    """The last stage's answer for one request: the target's token for each computed row.

    `failed`: some stage ran out of KV for this request (node_ids and tokens are empty). Every
    stage has freed the request's KV and drops its rows until the driver releases it; the driver
    then re-queues it under a fresh request id. At most one such result comes per request id.
    """

    request_id: int
    node_ids: list[int]  # (N,)
    tokens: list[int]  # (N,)
    failed: bool = False
    # (N,) only for a request that asked for them (SamplingParams.logprobs): each row's target
    # log-probabilities (sampling.target_logprobs); the driver keeps those of committed nodes.
    logprobs: Optional[list[TokenLogprobs]] = None


@dataclass
class StageStats:
    """One stage's accounting, reported to the driver when a step's Control has report=True.

    The one definition of the report's fields: the stage worker fills them, the stage process
    sends them as floats in this order, and the driver decodes them with `from_values`.
    Counters in CUMULATIVE are summed over the run (difference two reports for a window; divide
    by steps for per-step figures); the others are levels at the time of the report.
    """

    steps: int = 0
    compute_s: float = 0.0  # time in forward passes
    wait_s: float = 0.0  # time blocked on receiving (set by the transport loop)
    bytes_sent: int = 0  # activation + control bytes sent downstream (set by the transport)
    rows_computed: int = 0
    rows_committed: int = 0  # computed rows that ended on the committed path: useful work
    requests_failed: int = 0  # requests dropped here because the KV pool ran out
    peak_slots: int = 0  # most KV slots in use at once
    blocks_in_use: int = 0  # KV blocks held by requests now
    num_blocks: int = 0  # KV blocks in this stage's pool
    rss_bytes: int = 0  # resident memory of the process running the stage (in-process stages share
    peak_rss_bytes: int = 0  # the driver's process: each reports all of it)
    weight_bytes: int = 0  # the stage's weights as held (quantized blocks stay packed)
    kv_bytes: int = 0  # the stage's KV cache
    window_blocks: int = 0  # blocks in the sliding-window layers' own pool (0: none)
    window_blocks_in_use: int = 0

    CUMULATIVE: ClassVar[tuple[str, ...]] = (
        "steps", "compute_s", "wait_s", "bytes_sent", "rows_computed", "rows_committed", "requests_failed")

    def values(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_values(cls, values: list[float]) -> dict:
        """The report dict from `values()`; ValueError when the count does not match."""
        fs = fields(cls)
        if len(values) != len(fs):
            raise ValueError(f"a stage report has {len(fs)} values, got {len(values)}")
        # Each field's default (0 or 0.0) gives its type: counts travel as floats, return as ints.
        return cls(**{f.name: type(f.default)(v) for f, v in zip(fs, values)}).as_dict()

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["occupancy"] = self.rows_committed / self.rows_computed if self.rows_computed else None
        return d


class StagesRestarted(RuntimeError):
    """Raised by `submit` or `collect` when the stages were started afresh (one had died): they
    hold no request any more, so the driver recomputes every request that was in the pipeline."""


class Pipeline(Protocol):
    """What the driver sees of the stages, in-process or across machines.

    `step` is one pipeline step: every stage applies `control`, stage 1 takes `rows`, every stage
    computes what it received the step before, and the results leaving the last stage return.
    Rows fed at step t come back at step t + S - 1.

    Statistics ride on ordinary steps: after `collect` of a step whose Control had report=True,
    `reported` holds each stage's `StageStats.as_dict()` (stage 1 first; [] when the pipeline has
    no real stages) plus "spans": [(step, start_ns, end_ns)], when the stage computed in each step
    since its last report (perf_counter_ns; `step` counts like `steps`); after any other step it
    is None.
    """

    num_stages: int
    reported: Optional[list[dict]]
    steps: int  # steps submitted so far: the stages number their steps 1, 2, ... the same way
    # True when the stages compute between submit and collect while the driver drafts (stage
    # processes); False when they compute inside collect (in-process, simulated).
    concurrent: bool

    def submit(self, control: Control, rows: list[Rows]) -> None:
        """Start a step: control to every stage, rows into stage 1."""

    def collect(self) -> list[Results]:
        """Finish the step started by `submit`: what left the last stage."""

    def step(self, control: Control, rows: list[Rows]) -> list[Results]:
        """`submit` then `collect`."""

    def close(self) -> None: ...
