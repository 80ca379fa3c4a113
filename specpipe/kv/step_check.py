"""What a stage accepts from one step's messages, checked against its slot table before anything
changes: a refused step leaves the stage exactly as it was.

    check_control(table, control)          the driver's Control alone       -> ControlRefused
    StepView(table, control).rows(...)     each Rows, against the requests  -> RowsRefused
                                           as that Control will leave them

Two functions, so that the caller can tell whose message was at fault: the driver's Control, or
the Rows from the previous rank (the driver's own for stage 1). Both only read the table; the
rules themselves are the table's (`SlotTable.share_plan`, `check_tree`), so what is checked here
is what applying the step would do, not a copy of it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

from specpipe.messages import NO_PARENT, Control
from specpipe.kv.slot_table import ControlRefused, KVStateError, SlotTable, check_tree, unpruned


def check_control(table: SlotTable, control: Control) -> None:
    """The Control applies without an error, in `StageWorker.apply`'s order: shares, releases,
    evictions, admits, prunings (ControlRefused naming what is wrong)."""
    released = set(control.release)
    before = set(table.cached)
    cached = set(before)  # cache ids held once the shares are made
    lost = set(table.lost)
    readers = Counter({c: n for c, n in table.readers.items() if n})
    shared: set[int] = set()
    for sh in control.share:
        r = table.requests.get(sh.request_id)
        if r is None or sh.request_id in shared:
            raise ControlRefused(f"blocks of request {sh.request_id} shared, which this stage "
                                 f"{'does not hold' if r is None else 'was told to share twice in one step'}")
        shared.add(sh.request_id)
        if r.failed:
            lost.update(sh.ids)
            continue
        try:
            runs, _ = table.share_plan(sh.request_id, sh.blocks, sh.ids, sh.request_id in released,
                                       frozenset(cached - before))
        except KVStateError as e:
            raise ControlRefused(str(e)) from None
        cached.update(c for _, c, _ in runs)
        readers.update(c for _, c, _ in runs)
    for rid in released:
        r = table.requests.get(rid)
        if r is not None:
            readers.subtract(r.cached)
            if rid in shared and not r.failed:
                readers.subtract(next(sh.ids for sh in control.share if sh.request_id == rid))
    for c in control.evict:
        if c in lost:
            lost.discard(c)
        elif c not in cached or readers[c] > 0:
            raise ControlRefused(f"cache id {c} evicted while {'absent' if c not in cached else 'read'}")
        else:
            cached.discard(c)
    admitted: set[int] = set()
    for a in control.admit:
        rid = a.request_id
        if rid in admitted or (rid in table.requests and rid not in released):
            raise ControlRefused(f"request {rid} admitted twice")
        admitted.add(rid)
        if lost.intersection(a.cached):
            continue  # it starts failed here (SlotTable.admit)
        if len(set(a.cached)) != len(a.cached) or not cached.issuperset(a.cached) or (a.cached and table.window is not None):
            raise ControlRefused(f"request {rid} admitted with cached blocks {a.cached} this stage does not hold")
    # Every request the driver keeps here needs a slot for its rows: more than the pool has slots
    # can never all run (a hostile driver's way to grow the table without rows).
    held = len(table.requests) - len(released & set(table.requests)) + len(admitted)
    if held > table.num_slots:
        raise ControlRefused(f"{held} requests held here, more than the pool's {table.num_slots} slots")
    pending = Counter()
    for p in control.prune:
        r = table.requests.get(p.request_id)
        pending[p.request_id] += len(p.commit)
        waiting = pending[p.request_id] + (0 if r is None or p.request_id in released else len(r.pending))
        # A commit waits for its row here; every such row will need a slot, so more waiting commits
        # than the pool has slots can never settle (a hostile driver's way to grow a deque for ever).
        if waiting > table.num_slots:
            raise ControlRefused(f"request {p.request_id}: {waiting} commits waiting, "
                                 f"more than the {table.num_slots} slots that could ever hold them")


@dataclass
class _View:
    """A request as the step's Control will leave it: what `check_tree` and the live-row filter read."""

    spec: dict[int, tuple[int, int, int]]
    tip: Optional[int]
    held: int
    dropped: dict[int, int]
    pending: deque = field(default_factory=deque)


class StepView:
    """The requests as `control` (checked by check_control) will leave them, built as rows ask;
    `rows` checks a Rows message against them, and counts its rows in for the next message of
    the same request (parts of one request may follow each other in a step). Reads only."""

    def __init__(self, table: SlotTable, control: Control) -> None:
        self.table, self.control = table, control
        self.views: dict[int, Optional[_View]] = {}
        # Cache ids lost here once the Control is applied (shared by a request failed here, and
        # not evicted since): a request admitted with one starts failed (SlotTable.admit).
        self.lost = table.lost.union(*(sh.ids for sh in control.share
                                       if sh.request_id in table.requests and table.requests[sh.request_id].failed))
        self.lost -= set(control.evict)

    def fail(self, request_id: int) -> None:
        """A failure marker came for the request: its later rows in this step are dropped."""
        self.views[request_id] = None

    def rows(self, request_id: int, node_ids: list[int], parent_ids: list[int], positions: list[int]) -> list[int]:
        """The indices of the rows the stage will compute (the others were pruned in flight, or
        their request is gone or failed here); RowsRefused when those break the tree's rule."""
        v = self._view(request_id)
        if v is None:
            return []
        keep = unpruned(v.dropped, node_ids)
        if not keep:
            return keep
        nodes = [node_ids[i] for i in keep]
        at, v.tip = check_tree(v, request_id, nodes, [parent_ids[i] for i in keep], [positions[i] for i in keep])
        v.spec.update((n, (-1, parent_ids[i], pos)) for n, i, pos in zip(nodes, keep, at))
        return keep

    def _view(self, rid: int) -> Optional[_View]:
        if rid not in self.views:
            self.views[rid] = self._after_control(rid)
        return self.views[rid]

    def _after_control(self, rid: int) -> Optional[_View]:
        table, c = self.table, self.control
        admit = next((a for a in c.admit if a.request_id == rid), None)
        r = table.requests.get(rid)
        if admit is not None:
            if self.lost.intersection(admit.cached):
                return None  # it starts failed here
            v = _View({}, None if admit.cached else NO_PARENT, len(admit.cached) * table.block_size, {})
        elif r is None or r.failed or rid in c.release:
            return None  # its rows are dropped
        else:
            oldest = table.clock + 1 - table.horizon  # `tick` comes first
            v = _View(dict(r.spec), r.tip, r.held, {n: s for n, s in r.dropped.items() if s >= oldest},
                      deque(r.pending))
        for p in c.prune:  # SlotTable.drop then SlotTable.commit, in order
            if p.request_id != rid:
                continue
            for n in p.drop:
                if v.spec.pop(n, None) is None and table.horizon:
                    v.dropped[n] = table.clock + 1
            v.pending += p.commit
            while v.pending and v.pending[0] in v.spec:
                v.tip = v.pending.popleft()
                del v.spec[v.tip]
                v.held += 1
        return v
