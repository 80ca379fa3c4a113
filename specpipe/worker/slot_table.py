"""Per-stage KV bookkeeping for every request: which cache slot holds which token or tree node.

Pure Python (numpy for the mask): no torch, no model. A stage keeps, per request,
  committed  -- slots of the committed prefix, in position order;
  spec       -- tree nodes computed here and still alive: node id -> (slot, parent id);
  pending    -- node ids already committed by the driver but not yet computed at this stage
                (in SpecPipe the driver commits a child while it is still inside the last stages);
  dropped    -- node ids pruned by the driver, so rows still travelling towards this stage are
                recognised and discarded before they are computed.
Committing a node moves its slot from `spec` to `committed`: no KV row is copied. Pruning frees
slots. So the cache holds exactly committed length + live nodes, never pruned work.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specpipe.messages import NO_PARENT




class KVCacheFull(RuntimeError):
    """No free slot is left: the context plus the speculative tree do not fit in the cache."""


class SlotAllocator:
    """Free-list of cache slots. Pure Python; hands out the lowest free slots first so that a
    sequence decoded without speculation keeps contiguous slots (and reads them as one slice)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._next = 0  # slots >= _next have never been handed out
        self._freed: list[int] = []  # returned slots, reused before fresh ones

    def alloc(self, n: int) -> list[int]:
        if n > self.num_free():
            raise KVCacheFull(
                f"KV cache full: {n} slots requested, {self.num_free()} of {self.num_slots} free")
        take = min(n, len(self._freed))
        out = sorted(self._freed[-take:]) if take else []
        del self._freed[len(self._freed) - take:]
        fresh = n - take
        out.extend(range(self._next, self._next + fresh))
        self._next += fresh
        return out

    def free(self, slots: list[int]) -> None:
        self._freed.extend(slots)
        # Keep the largest at the front so that alloc() pops the smallest ones.
        self._freed.sort(reverse=True)

    def num_free(self) -> int:
        return self.num_slots - self._next + len(self._freed)

    def num_used(self) -> int:
        return self.num_slots - self.num_free()


class KVStateError(RuntimeError):
    """The driver and a stage disagree about a request's tree (a bug, never user error)."""


@dataclass
class RequestSlots:
    committed: list[int] = field(default_factory=list)
    spec: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (slot, parent)
    pending: deque = field(default_factory=deque)
    dropped: set[int] = field(default_factory=set)

    def num_slots(self) -> int:
        return len(self.committed) + len(self.spec)


@dataclass
class RowPlan:
    """Where a batch of rows writes and what it reads: the input of AttentionMetadata.build."""

    write_slots: list[int]  # (T,)
    read_slots: list[int]  # (C,)
    mask: np.ndarray | None  # (T, C) bool; None when every row sees every read slot


class KVManager:
    def __init__(self, num_slots: int) -> None:
        self.allocator = SlotAllocator(num_slots)
        self.requests: dict[int, RequestSlots] = {}

    # -- control ------------------------------------------------------------------------------
    def admit(self, request_id: int) -> None:
        if request_id in self.requests:
            raise KVStateError(f"request {request_id} admitted twice")
        self.requests[request_id] = RequestSlots()

    def release(self, request_id: int) -> None:
        r = self.requests.pop(request_id, None)
        if r is not None:
            self.allocator.free(r.committed + [s for s, _ in r.spec.values()])

    def commit(self, request_id: int, node_ids: list[int]) -> None:
        r = self.requests[request_id]
        r.pending.extend(node_ids)
        self._settle(r)

    def drop(self, request_id: int, node_ids: list[int]) -> None:
        r = self.requests[request_id]
        r.dropped.update(node_ids)
        freed = [r.spec.pop(n)[0] for n in node_ids if n in r.spec]
        self.allocator.free(freed)

    def _settle(self, r: RequestSlots) -> None:
        # Commits arrive in path order; a node not yet computed here waits at the head.
        while r.pending and r.pending[0] in r.spec:
            r.committed.append(r.spec.pop(r.pending.popleft())[0])

    # -- rows -----------------------------------------------------------------------------------
    def live_rows(self, request_id: int, node_ids: list[int]) -> list[int]:
        """Indices of the incoming rows that were not pruned while they travelled."""
        dropped = self.requests[request_id].dropped
        return [i for i, n in enumerate(node_ids) if n not in dropped]

    def plan(self, request_id: int, node_ids: list[int], parent_ids: list[int]) -> RowPlan:
        """Allocate slots for new rows and derive what each may attend to: the committed prefix,
        its own ancestors among the live tree nodes, and itself."""
        r = self.requests[request_id]
        slots = self.allocator.alloc(len(node_ids))
        for n, p, s in zip(node_ids, parent_ids, slots):
            if n in r.spec:
                raise KVStateError(f"request {request_id}: node {n} computed twice at this stage")
            if p != NO_PARENT and p in r.dropped:
                raise KVStateError(f"request {request_id}: node {n} arrived after its parent {p} was pruned")
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

    def computed(self, request_id: int) -> None:
        """Called after the rows planned last were computed: pending commits may now settle."""
        self._settle(self.requests[request_id])

    def _chain(self, r: RequestSlots, node: int) -> list[int]:
        out = []
        while node in r.spec:
            out.append(node)
            node = r.spec[node][1]
        return out

    # -- accounting -----------------------------------------------------------------------------
    def slots_in_use(self, request_id: int) -> int:
        return self.requests[request_id].num_slots()

    def total_in_use(self) -> int:
        return self.allocator.num_used()


def _is_chain(node_ids: list[int], parent_ids: list[int]) -> bool:
    return all(parent_ids[i] == node_ids[i - 1] for i in range(1, len(node_ids)))
