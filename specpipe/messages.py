"""The messages that cross between the driver and the stages: small typed dataclasses.

Exactly three kinds travel, one of each per link per pipeline step (an empty one when there is
nothing to say), which keeps every link in lock-step and the pipeline free of deadlocks:

  Control   driver -> every stage   what to commit, prune, admit or release before computing
  Rows      driver -> stage 1, stage s -> stage s+1 (and stage S -> driver as `Results`)
  Results   stage S -> driver        the target's token for each surviving row

Control data are plain lists of ints; only the activations are a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from specpipe.sampling import SamplingParams

NO_PARENT = -1  # parent id of a request's very first token

@dataclass
class Admit:
    """A new request enters the stages; the last stage needs its sampling parameters."""

    request_id: int
    sampling: SamplingParams


@dataclass
class Prune:
    """Pruning propagation for one request (SPEC §4 phase 2)."""

    request_id: int
    commit: list[int] = field(default_factory=list)  # node ids joining the committed prefix, in order
    drop: list[int] = field(default_factory=list)  # node ids whose subtrees are pruned


@dataclass
class Control:
    admit: list[Admit] = field(default_factory=list)
    prune: list[Prune] = field(default_factory=list)
    release: list[int] = field(default_factory=list)  # finished request ids: free all their KV
    report: bool = False  # every stage sends its cumulative StageStats to the driver
    shutdown: bool = False

    def empty(self) -> bool:
        return not (self.admit or self.prune or self.release or self.report or self.shutdown)


@dataclass
class Rows:
    """Tree nodes (or prompt/decode tokens) of one request travelling down the pipeline.

    Parents precede their children within a message; every parent is either committed or a node
    that this stage has already computed (the pipeline is FIFO, so ancestors always arrive first).
    """

    request_id: int
    node_ids: list[int]  # (T,)
    parent_ids: list[int]  # (T,) NO_PARENT only for the first prompt token
    positions: list[int]  # (T,) absolute positions
    data: torch.Tensor  # (T,) token ids into stage 1, (T, H) hidden states after
    head_rows: Optional[list[int]] = None  # rows whose target token is wanted; None = all

    def __len__(self) -> int:
        return len(self.node_ids)

    def select(self, keep: list[int]) -> "Rows":
        """Only the rows at indices `keep` (pruned rows are dropped before they are sent on)."""
        if len(keep) == len(self.node_ids):
            return self
        idx = torch.tensor(keep, dtype=torch.long, device=self.data.device)
        wanted = None if self.head_rows is None else set(self.head_rows)
        return Rows(
            request_id=self.request_id,
            node_ids=[self.node_ids[i] for i in keep],
            parent_ids=[self.parent_ids[i] for i in keep],
            positions=[self.positions[i] for i in keep],
            data=self.data.index_select(0, idx),
            head_rows=None if wanted is None else [j for j, i in enumerate(keep) if i in wanted],
        )


@dataclass
class Results:
    """The last stage's answer for one request: the target's token for each computed row."""

    request_id: int
    node_ids: list[int]
    tokens: list[int]


class Pipeline(Protocol):
    """What the driver sees of the stages, in-process or across machines.

    `step` is one pipeline step: every stage applies `control`, stage 1 takes `rows`, every stage
    computes what it received the step before, and the results leaving the last stage return.
    Rows fed at step t come back at step t + S - 1.
    """

    num_stages: int

    def submit(self, control: Control, rows: list[Rows]) -> None:
        """Start a step: control to every stage, rows into stage 1."""

    def collect(self) -> list[Results]:
        """Finish the step started by `submit`: what left the last stage."""

    def step(self, control: Control, rows: list[Rows]) -> list[Results]:
        """`submit` then `collect`."""

    def stage_stats(self) -> list[dict]: ...

    def close(self) -> None: ...
