"""Per-stage KV bookkeeping for every request: which cache slot holds which token or tree node.

Pure Python (numpy for the mask): no torch, no model. The cache is paged: a pool of `num_blocks`
blocks of `block_size` slots each (block b holds slots b*block_size .. (b+1)*block_size - 1).
A stage keeps, per request,
  blocks     -- the block ids it owns (its block table); all its slots come from them;
  free       -- its own slots not in use, handed out lowest first, so that a sequence decoded
                without speculation fills a block in order and reads contiguous slots;
  committed  -- slots of the committed prefix, in position order;
  spec       -- tree nodes computed here and still alive: node id -> (slot, parent id);
  pending    -- node ids already committed by the driver but not yet computed at this stage
                (in SpecPipe the driver commits a child while it is still inside the last stages);
  dropped    -- node ids pruned by the driver before their rows reached this stage (node id ->
                the table's step when pruned), so those rows are recognised and discarded. Kept
                only while such a row can still arrive: the pipeline is lock-step, so a row the
                driver sent before the pruning reaches stage i (0-based) within i steps, or was
                discarded upstream and never comes. After `horizon` steps the id is forgotten:
                `dropped` stays bounded for a request's life (ids computed here are not kept);
  failed     -- the pool ran out for this request here: its KV is freed and its rows are dropped
                until the driver releases it.
Committing a node moves its slot from `spec` to `committed`: no KV row is copied. Pruning returns
slots to the request's own free list. So the cache holds exactly committed length + live nodes,
never pruned work.

The block rule, which the driver's block manager mirrors to admit requests: a request takes a new
block from the pool only when all of its own slots are in use, and gives its blocks back only when
it is released (or fails). So a request holds exactly ceil(peak slots in use / block_size) blocks.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specpipe.messages import NO_PARENT


class KVCacheFull(RuntimeError):
    """The block pool is empty: this request's context plus its speculative tree do not fit."""


class KVStateError(RuntimeError):
    """The driver and a stage disagree about a request's tree (a bug, never user error)."""


class BlockPool:
    """The stage's free blocks, lowest id first (so that runs are reproducible)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks))  # a heap

    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise KVCacheFull(f"KV cache full: all {self.num_blocks} blocks of {self.block_size} slots in use")
        return heapq.heappop(self._free)

    def give(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)


@dataclass
class RequestSlots:
    committed: list[int] = field(default_factory=list)
    spec: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (slot, parent)
    pending: deque = field(default_factory=deque)
    dropped: dict[int, int] = field(default_factory=dict)  # node -> the table's step when pruned
    blocks: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # a heap of this request's unused slots
    failed: bool = False

    def num_slots(self) -> int:
        return len(self.committed) + len(self.spec)


@dataclass
class RowPlan:
    """Where a batch of rows writes and what it reads: one segment of AttentionMetadata."""

    write_slots: list[int]  # (T,)
    read_slots: list[int]  # (C,)
    mask: np.ndarray | None  # (T, C) bool; None when every row sees every read slot


MAX_HORIZON = 64  # steps a pruned row may still travel: enough for a pipeline of up to 63 stages


class SlotTable:
    def __init__(self, num_blocks: int, block_size: int, horizon: int = MAX_HORIZON) -> None:
        """`horizon`: steps after a pruning during which rows of pruned nodes may still arrive
        here (a stage's index + 1; a draft model, fed synchronously, 0)."""
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.requests: dict[int, RequestSlots] = {}
        self.horizon = horizon
        self.clock = 0  # steps seen (tick)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_slots(self) -> int:
        """Size of the KV cache this table addresses."""
        return self.pool.num_blocks * self.block_size

    # -- control ------------------------------------------------------------------------------
    def tick(self) -> None:
        """A new step begins: forget pruned ids whose rows can no longer arrive."""
        self.clock += 1
        oldest = self.clock - self.horizon
        for r in self.requests.values():
            if r.dropped and min(r.dropped.values()) < oldest:
                r.dropped = {n: c for n, c in r.dropped.items() if c >= oldest}

    def admit(self, request_id: int) -> None:
        if request_id in self.requests:
            raise KVStateError(f"request {request_id} admitted twice")
        self.requests[request_id] = RequestSlots()

    def release(self, request_id: int) -> None:
        r = self.requests.pop(request_id, None)
        if r is not None:
            self.pool.give(r.blocks)

    def fail(self, request_id: int) -> None:
        """Free the request's KV and drop whatever still arrives for it, until it is released."""
        self.pool.give(self.requests[request_id].blocks)
        self.requests[request_id] = RequestSlots(failed=True)

    def commit(self, request_id: int, node_ids: list[int]) -> int:
        """Queue commits (in path order); returns how many nodes joined the committed prefix now."""
        r = self.requests[request_id]
        if r.failed:
            return 0
        r.pending.extend(node_ids)
        return self._settle(r)

    def drop(self, request_id: int, node_ids: list[int]) -> None:
        r = self.requests[request_id]
        if r.failed:
            return
        for n in node_ids:
            if n in r.spec:  # computed here already: its row will not come again
                heapq.heappush(r.free, r.spec.pop(n)[0])
            elif self.horizon:
                r.dropped[n] = self.clock

    def _settle(self, r: RequestSlots) -> int:
        # Commits arrive in path order; a node not yet computed here waits at the head.
        before = len(r.committed)
        while r.pending and r.pending[0] in r.spec:
            r.committed.append(r.spec.pop(r.pending.popleft())[0])
        return len(r.committed) - before

    # -- rows -----------------------------------------------------------------------------------
    def live_rows(self, request_id: int, node_ids: list[int]) -> list[int]:
        """Indices of the incoming rows that were not pruned while they travelled."""
        r = self.requests[request_id]
        if r.failed:
            return []
        # The ids stay until the horizon: a pruned node's children, which follow it, are refused too.
        return [i for i, n in enumerate(node_ids) if n not in r.dropped]

    def plan(self, request_id: int, node_ids: list[int], parent_ids: list[int]) -> RowPlan:
        """Allocate slots for new rows (at least one) and derive what each may attend to: the
        committed prefix, its own ancestors among the live tree nodes, and itself.

        Everything is checked before any slot is taken, so a refused plan (KVStateError, or
        KVCacheFull when the pool has too few blocks) leaves the table as it was."""
        r = self.requests[request_id]
        if r.failed:
            raise KVStateError(f"request {request_id}: rows planned after it failed at this stage")
        if not node_ids or len(parent_ids) != len(node_ids):
            raise KVStateError(f"request {request_id}: {len(node_ids)} rows with {len(parent_ids)} parents")
        if len(set(node_ids)) != len(node_ids) or any(n in r.spec for n in node_ids):
            raise KVStateError(f"request {request_id}: a node computed twice at this stage ({node_ids})")
        for n, p in zip(node_ids, parent_ids):
            if p != NO_PARENT and p in r.dropped:
                raise KVStateError(f"request {request_id}: node {n} arrived after its parent {p} was pruned")
        new_blocks = -(-max(0, len(node_ids) - len(r.free)) // self.block_size)
        if new_blocks > self.pool.num_free():
            raise KVCacheFull(
                f"KV cache full: request {request_id} needs {new_blocks} more blocks of {self.block_size} "
                f"slots, {self.pool.num_free()} of {self.pool.num_blocks} free")
        slots = self._alloc(r, len(node_ids))
        for n, p, s in zip(node_ids, parent_ids, slots):
            r.spec[n] = (s, p)
        if _is_chain(node_ids, parent_ids) and parent_ids[0] not in r.spec:
            # Prefill or plain decode: rows extend the committed prefix one after another.
            read = r.committed + slots
            if len(slots) == 1:
                return RowPlan(slots, read, None)
            base = len(r.committed)
            mask = np.ones((len(slots), len(read)), dtype=bool)
            mask[:, base:] = np.tri(len(slots), dtype=bool)
            return RowPlan(slots, read, mask)
        # The speculative columns: every live ancestor-or-self of the new rows.
        chains = [self._chain(r, n) for n in node_ids]
        cols: dict[int, int] = {}
        for chain in chains:
            for n in chain:
                cols.setdefault(n, len(cols))
        base = len(r.committed)
        read = r.committed + [r.spec[n][0] for n in cols]
        mask = np.zeros((len(node_ids), base + len(cols)), dtype=bool)
        mask[:, :base] = True
        for i, chain in enumerate(chains):
            mask[i, [base + cols[n] for n in chain]] = True
        return RowPlan(slots, read, mask)

    def _alloc(self, r: RequestSlots, n: int) -> list[int]:
        """n slots: the request's own free ones first (lowest first), then fresh blocks in order.
        The caller has checked that the pool has enough blocks."""
        out = [heapq.heappop(r.free) for _ in range(min(n, len(r.free)))]
        while len(out) < n:
            b = self.pool.take()
            r.blocks.append(b)
            fresh = range(b * self.block_size, (b + 1) * self.block_size)
            take = min(n - len(out), self.block_size)
            out.extend(fresh[:take])
            for s in fresh[take:]:
                heapq.heappush(r.free, s)
        return out

    def computed(self, request_id: int) -> int:
        """Called after the rows planned last were computed: pending commits may now settle.
        Returns how many nodes joined the committed prefix."""
        r = self.requests[request_id]
        return 0 if r.failed else self._settle(r)

    def _chain(self, r: RequestSlots, node: int) -> list[int]:
        out = []
        while node in r.spec:
            out.append(node)
            node = r.spec[node][1]
        return out

    # -- accounting -----------------------------------------------------------------------------
    def total_in_use(self) -> int:
        """Slots holding a committed token or a live node, over all requests."""
        return sum(r.num_slots() for r in self.requests.values())

    def blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free()


def _is_chain(node_ids: list[int], parent_ids: list[int]) -> bool:
    return all(parent_ids[i] == node_ids[i - 1] for i in range(1, len(node_ids)))
