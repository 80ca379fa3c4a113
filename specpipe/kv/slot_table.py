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

Sliding-window layers (Gemma 3, Mistral) keep their KV in a table of their own (`window_pool`): the
same rows are planned there, but a committed slot leaves the table once no row can still see it.
Every row yet to arrive at a stage sits at a position >= P, the committed prefix's length here (the
driver never sends a row behind it), and a row sees keys at positions > its own - window; so the
committed positions below P - window + 1 are *evicted*: their slots go back to the request's free
list and every block left wholly free goes back to the pool. The block rule still holds (a new
block only when all the request's slots are in use), so a request holds at most
ceil(peak slots in use / block_size) blocks, where its slots in use are its last window - 1
committed tokens plus its live tree nodes, however long its context. The driver's block manager
mirrors this too (sched/block_manager.py).

Prefix caching: the driver names full blocks of committed positions by a cache id
(sched/prefix_cache.py) and this table keeps `cached`: id -> the pool block holding it, and how
many requests read it. A block joins the cache when the driver says so (`share`): a request's
block that holds exactly its positions k*B .. (k+1)*B - 1 in order (a prompt, or plain decoding)
moves from the request's own blocks to the cache as it is; at the request's release, positions
that speculation scattered over several blocks are first copied into one of its blocks (`share`
returns those copies for the caller to make in the KV tensors). A request admitted with cached
ids starts with their slots as its committed prefix; it never writes them (its new rows take
its own blocks). Cached blocks that nobody reads stay until the driver evicts them: this table
never takes one on its own, so its free blocks are exactly the driver's count.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from specpipe.messages import NO_PARENT


class KVCacheFull(RuntimeError):
    """The block pool is empty: this request's context plus its speculative tree do not fit."""


class KVStateError(RuntimeError):
    """The driver and a stage disagree about a request's tree (a bug, never user error).
    `source`: which message broke the table's rules, when the check knows: "control" (the
    driver's Control) or "rows" (the Rows from the previous rank, or the driver for stage 1);
    None for a fault found later, the stage's own."""

    source: Optional[str] = None


class ControlRefused(KVStateError):
    """The driver's Control contradicts this stage's state (an unknown request or cache id, a run
    not settled here, a request admitted twice): refused before anything changed."""

    source = "control"


class RowsRefused(KVStateError):
    """Rows whose tree contradicts this stage's state (a parent it does not hold, a node declared
    twice, a position that is not its parent's + 1): refused before anything changed."""

    source = "rows"


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
    spec: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # node -> (slot, parent, position)
    pending: deque = field(default_factory=deque)
    dropped: dict[int, int] = field(default_factory=dict)  # node -> the table's step when pruned
    blocks: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # a heap of this request's unused slots
    failed: bool = False
    evicted: int = 0  # committed positions no longer held (a sliding-window table): committed[0]'s position
    cached: list[int] = field(default_factory=list)  # cache ids of the blocks it reads (not its own)
    # The node id of the last committed position: the one parent outside `spec` a new row may
    # name. NO_PARENT before anything is committed; None while unknown (a prefix read from cached
    # blocks, whose node ids this table never saw: the first row that names one teaches it).
    tip: Optional[int] = NO_PARENT

    def num_slots(self) -> int:
        return len(self.committed) + len(self.spec)

    @property
    def held(self) -> int:
        """Committed positions, evicted ones included: the position of the tip's child."""
        return self.evicted + len(self.committed)


@dataclass
class RowPlan:
    """Where a batch of rows writes and what it reads: one segment of AttentionMetadata."""

    write_slots: list[int]  # (T,)
    read_slots: list[int]  # (C,)
    mask: np.ndarray | None  # (T, C) bool; None when every row sees every read slot
    window: Optional["RowPlan"] = None  # the same rows in the sliding-window layers' table, if any


MAX_HORIZON = 64  # steps a pruned row may still travel: enough for a pipeline of up to 63 stages


class SlotTable:
    def __init__(self, num_blocks: int, block_size: int, horizon: int = MAX_HORIZON,
                 window_pool: Optional[tuple[int, int]] = None, evict_behind: Optional[int] = None) -> None:
        """`horizon`: steps after a pruning during which rows of pruned nodes may still arrive
        here (a stage's index + 1; a draft model, fed synchronously, 0).
        `window_pool`: (window, blocks): the stage's sliding-window layers keep their KV in a table
        of their own, `self.window`, of that many blocks, planned with the same rows.
        `evict_behind`: this table is such a window table: it forgets committed positions that
        no row can see any more (see the module's docstring)."""
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.requests: dict[int, RequestSlots] = {}
        self.cached: dict[int, int] = {}  # cache id -> pool block (prefix caching)
        self.readers: Counter = Counter()  # cache id -> requests reading it
        self.idle = 0  # cached blocks nobody reads
        self.lost: set[int] = set()  # cache ids shared by a request that had failed here: never held
        self.horizon = horizon
        self.clock = 0  # steps seen (tick)
        self.evict_behind = evict_behind
        # Its rows are filtered by this table (live_rows), so it keeps no pruned ids (horizon 0).
        self.window = (SlotTable(window_pool[1], block_size, 0, evict_behind=window_pool[0])
                       if window_pool is not None else None)

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

    def admit(self, request_id: int, cached: list[int] = ()) -> bool:
        """A new request; `cached`: the cache ids of the blocks holding its first positions.
        False when one of those was lost here (`share`): the request starts failed."""
        if request_id in self.requests:
            raise KVStateError(f"request {request_id} admitted twice")
        if self.lost.intersection(cached):  # see `share`: it starts failed here
            self.requests[request_id] = RequestSlots(failed=True)
            if self.window is not None:
                self.window.admit(request_id)
            return False
        missing = [c for c in cached if c not in self.cached]
        if missing or (cached and self.window is not None):
            raise KVStateError(f"request {request_id} admitted with cached blocks {missing or cached} "
                               "this table does not hold")
        self.requests[request_id] = RequestSlots()
        self._read_cached(self.requests[request_id], cached)
        if self.window is not None:
            self.window.admit(request_id)
        return True

    def adopt(self, request_id: int, cached: list[int]) -> None:
        """A request admitted already, with nothing placed yet, starts with these cached blocks
        (a draft model learns its prompt only when the rows come): their positions leave the
        commits it was told of."""
        r = self.requests[request_id]
        if r.failed or r.committed or r.spec or self.window is not None:
            raise KVStateError(f"request {request_id}: cached blocks adopted after its rows")
        self._read_cached(r, cached)
        for _ in range(min(len(r.committed), len(r.pending))):
            r.tip = r.pending.popleft()  # the commits told before: the cached positions' own ids

    def _read_cached(self, r: RequestSlots, cached: list[int]) -> None:
        bs = self.block_size
        for c in cached:
            self.idle -= self.readers[c] == 0
            self.readers[c] += 1
            b = self.cached[c]
            r.committed.extend(range(b * bs, (b + 1) * bs))
        r.cached = list(cached)
        if cached:
            r.tip = None  # the cached positions' node ids are the driver's: learned from the first row

    def release(self, request_id: int) -> None:
        r = self.requests.pop(request_id, None)
        if r is not None:
            self._let_go(r)
        if self.window is not None:
            self.window.release(request_id)

    def fail(self, request_id: int) -> None:
        """Free the request's KV and drop whatever still arrives for it, until it is released."""
        self._let_go(self.requests[request_id])
        self.requests[request_id] = RequestSlots(failed=True)
        if self.window is not None:
            self.window.fail(request_id)

    def _let_go(self, r: RequestSlots) -> None:
        """Its own blocks back to the pool; the cached ones it read stay cached."""
        self.pool.give(r.blocks)
        for c in r.cached:
            self.readers[c] -= 1
            self.idle += self.readers[c] == 0
        r.blocks, r.cached = [], []

    # -- prefix caching ---------------------------------------------------------------------------
    def whole_block(self, request_id: int, k: int) -> Optional[int]:
        """The request's own block holding exactly positions k*B .. (k+1)*B - 1 in order, if one does."""
        r, bs = self.requests[request_id], self.block_size
        slots = r.committed[k * bs:(k + 1) * bs]
        b = slots[0] // bs if len(slots) == bs else None
        return b if b is not None and b in r.blocks and slots == list(range(b * bs, (b + 1) * bs)) else None

    def share(self, request_id: int, blocks: list[int], ids: list[int], final: bool = False) -> list[tuple[int, int]]:
        """Cache the request's block-aligned runs of committed positions: run k (positions
        k*B .. (k+1)*B - 1) under cache id ids[i] for k = blocks[i]. Each run must be settled here.
        A run held in order by one of its own blocks moves to the cache as it is; otherwise (a
        tree's rows scattered it) only at the request's release (`final`): its positions are then
        copied into one of its own blocks. Returns those copies, (from slot, to slot), for the
        caller to make in the KV before any other use of the slots."""
        r = self.requests.get(request_id)
        if r is None:
            raise KVStateError(f"request {request_id}: blocks shared that this table does not hold")
        if r.failed:
            # It ran out of KV here and the driver has not heard yet: these blocks are cached
            # everywhere else. A request that would read one fails here, and the driver computes
            # it again without the cache.
            self.lost.update(ids)
            return []
        runs, moves = self.share_plan(request_id, blocks, ids, final)
        bs = self.block_size
        for k, c, b in runs:
            r.committed[k * bs:(k + 1) * bs] = range(b * bs, (b + 1) * bs)  # as it was, or copied there
            r.blocks.remove(b)
            self.cached[c] = b
            self.readers[c] += 1
            r.cached.append(c)
        return moves

    def share_plan(self, request_id: int, blocks: list[int], ids: list[int], final: bool,
                   taken: frozenset = frozenset()) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """What `share` would do, changing nothing: (run, cache id, the block that will hold it)
        for each run, and the copies (from slot, to slot) into spare blocks, all to be made at
        once (every read before any write: a spare block may hold another run's sources).
        KVStateError when the driver asks for what cannot be. `taken`: cache ids claimed by an
        earlier Share of the same step (kv/step_check.py)."""
        r, bs = self.requests[request_id], self.block_size
        if len(blocks) != len(ids) or len(set(blocks)) != len(blocks) or len(set(ids)) != len(ids):
            raise KVStateError(f"request {request_id}: runs {blocks} shared as cache ids {ids}")
        runs = []
        for k, c in zip(blocks, ids):
            if c in self.cached or c in taken or not 0 <= k or (k + 1) * bs > len(r.committed):
                raise KVStateError(f"request {request_id}: run {k} shared as cache id {c}, but it is "
                                   f"{'cached already' if c in self.cached or c in taken else 'not settled here'}")
            runs.append((k, c, self.whole_block(request_id, k)))
        claimed = {b for _, _, b in runs if b is not None}
        spare = [b for b in r.blocks if b not in claimed]
        out, moves = [], []
        for k, c, b in runs:
            if b is None:
                if not final or not spare:
                    raise KVStateError(f"request {request_id}: run {k} is not one block's slots in order")
                b = spare.pop(0)
                src = r.committed[k * bs:(k + 1) * bs]
                moves += [(a, d) for a, d in zip(src, range(b * bs, (b + 1) * bs)) if a != d]
            out.append((k, c, b))
        return out, moves

    def evict(self, ids: list[int]) -> None:
        """Forget cached blocks nobody reads; their blocks go back to the pool."""
        for c in ids:
            if c in self.lost:
                self.lost.discard(c)
                continue
            if c not in self.cached or self.readers[c] > 0:
                raise KVStateError(f"cache id {c} evicted while {'absent' if c not in self.cached else 'read'}")
            self.pool.give([self.cached.pop(c)])
            del self.readers[c]
            self.idle -= 1

    def commit(self, request_id: int, node_ids: list[int]) -> int:
        """Queue commits (in path order); returns how many nodes joined the committed prefix now."""
        r = self.requests[request_id]
        if r.failed:
            return 0
        if self.window is not None:
            self.window.commit(request_id, node_ids)
        r.pending.extend(node_ids)
        return self._settle(r)

    def drop(self, request_id: int, node_ids: list[int]) -> None:
        r = self.requests[request_id]
        if r.failed:
            return
        if self.window is not None:
            self.window.drop(request_id, node_ids)
        for n in node_ids:
            if n in r.spec:  # computed here already: its row will not come again
                heapq.heappush(r.free, r.spec.pop(n)[0])
            elif self.horizon:
                r.dropped[n] = self.clock

    def _settle(self, r: RequestSlots) -> int:
        # Commits arrive in path order; a node not yet computed here waits at the head.
        before = len(r.committed)
        while r.pending and r.pending[0] in r.spec:
            r.tip = r.pending.popleft()
            r.committed.append(r.spec.pop(r.tip)[0])
        settled = len(r.committed) - before
        if settled and self.evict_behind is not None:
            self._evict(r)
        return settled

    def _evict(self, r: RequestSlots) -> None:
        """Forget the committed positions below P - window + 1 (P: the committed length), which
        no row still to come can see; whole blocks left free go back to the pool."""
        gone = len(r.committed) - self.evict_behind + 1
        if gone <= 0:
            return
        for s in r.committed[:gone]:
            heapq.heappush(r.free, s)
        del r.committed[:gone]
        r.evicted += gone
        if len(r.free) < self.block_size:
            return
        per_block = Counter(s // self.block_size for s in r.free)
        empty = {b for b, n in per_block.items() if n == self.block_size}
        if empty:
            r.blocks = [b for b in r.blocks if b not in empty]
            r.free = [s for s in r.free if s // self.block_size not in empty]
            heapq.heapify(r.free)
            self.pool.give(sorted(empty))

    # -- rows -----------------------------------------------------------------------------------
    def live_rows(self, request_id: int, node_ids: list[int]) -> list[int]:
        """Indices of the incoming rows that were not pruned while they travelled."""
        r = self.requests[request_id]
        if r.failed:
            return []
        return unpruned(r.dropped, node_ids)

    def plan(self, request_id: int, node_ids: list[int], parent_ids: list[int],
             positions: Optional[list[int]] = None) -> RowPlan:
        """Allocate slots for new rows (at least one) and derive what each may attend to: the
        committed prefix, its own ancestors among the live tree nodes, and itself. With a window
        table, the same rows are planned there too (`RowPlan.window`). `positions`: the rows'
        positions as sent, checked against the tree's (`check_tree`); the table derives them
        from the parents either way.

        Everything is checked before any slot is taken, so a refused plan (RowsRefused, or
        KVCacheFull when the pool has too few blocks) leaves the table as it was."""
        checked = self._check(request_id, node_ids, parent_ids, positions)
        if self.window is not None:
            window = self.window._check(request_id, node_ids, parent_ids, positions)
        plan = self._place(*checked, node_ids, parent_ids)
        if self.window is not None:
            plan.window = self.window._place(*window, node_ids, parent_ids)
        return plan

    def _check(self, request_id: int, node_ids: list[int], parent_ids: list[int],
               positions: Optional[list[int]]) -> tuple[RequestSlots, list[int], Optional[int]]:
        """The request, each row's position and the committed tip (`check_tree`), when the rows may be placed."""
        r = self.requests.get(request_id)
        if r is None:
            raise RowsRefused(f"rows for request {request_id}, which this stage does not hold")
        if r.failed:
            raise RowsRefused(f"request {request_id}: rows planned after it failed at this stage")
        at, tip = check_tree(r, request_id, node_ids, parent_ids, positions)
        new_blocks = -(-max(0, len(node_ids) - len(r.free)) // self.block_size)
        if new_blocks > self.pool.num_free():
            what = "sliding-window KV" if self.evict_behind is not None else "KV cache"
            raise KVCacheFull(
                f"{what} full: request {request_id} needs {new_blocks} more blocks of {self.block_size} "
                f"slots, {self.pool.num_free()} of {self.pool.num_blocks} free")
        return r, at, tip

    def _place(self, r: RequestSlots, at: list[int], tip: Optional[int], node_ids: list[int],
               parent_ids: list[int]) -> RowPlan:
        slots = self._alloc(r, len(node_ids))
        for n, p, s, pos in zip(node_ids, parent_ids, slots, at):
            r.spec[n] = (s, p, pos)
        r.tip = tip
        if _is_chain(node_ids, parent_ids) and parent_ids[0] not in r.spec:
            # Prefill or plain decode: rows extend the committed prefix one after another.
            read = r.committed + slots
            if len(slots) == 1:
                return RowPlan(slots, read, None)
            base = len(r.committed)
            mask = np.ones((len(slots), len(read)), dtype=bool)
            mask[:, base:] = np.tri(len(slots), dtype=bool)
            return RowPlan(slots, read, mask)
        # The speculative columns: every live ancestor-or-self of the new rows, each chain taken
        # root first, so that every row reads its visible slots in position order, as plain
        # decoding reads the same tokens: attention sums over slots in read order, and a row's
        # bits must not depend on the tree around it. (A chain's nodes already placed by an
        # earlier chain are its ancestors' end of it, so its own come after them.)
        chains = [self._chain(r, n) for n in node_ids]
        cols: dict[int, int] = {}
        for chain in chains:
            for n in reversed(chain):
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
        if r.failed:
            return 0
        if self.window is not None:
            self.window.computed(request_id)
        return self._settle(r)

    def _chain(self, r: RequestSlots, node: int) -> list[int]:
        """The node and its live ancestors, nearest first. `check_tree` keeps the parent links
        acyclic; the bound is a second line of defence: a walk longer than the live nodes is a
        loop, an error instead of a stage that spins for ever while its heartbeat says alive."""
        out = []
        while node in r.spec:
            if len(out) == len(r.spec):
                raise KVStateError(f"the ancestors of node {out[0]} loop back on themselves (through {node})")
            out.append(node)
            node = r.spec[node][1]
        return out

    # -- accounting -----------------------------------------------------------------------------
    def total_in_use(self) -> int:
        """Slots holding a committed token or a live node, over all requests."""
        return sum(r.num_slots() for r in self.requests.values())

    def blocks_in_use(self) -> int:
        """Blocks requests hold or read; cached blocks nobody reads count as free, as in vLLM
        (the driver evicts them as soon as a request needs the room)."""
        return self.pool.num_blocks - self.pool.num_free() - self.idle


def _is_chain(node_ids: list[int], parent_ids: list[int]) -> bool:
    return all(parent_ids[i] == node_ids[i - 1] for i in range(1, len(node_ids)))


def unpruned(dropped: dict[int, int], node_ids: list[int]) -> list[int]:
    """Indices of the rows whose node was not pruned while it travelled. The ids stay until the
    horizon: a pruned node's children, which follow it, are refused too (`check_tree`)."""
    return [i for i, n in enumerate(node_ids) if n not in dropped]


def check_tree(r: RequestSlots, request_id: int, node_ids: list[int], parent_ids: list[int],
               positions: Optional[list[int]] = None) -> tuple[list[int], Optional[int]]:
    """The rule every new row obeys, so that the parent links stay a tree across messages:
    its parent is a node the stage already holds (a live node, or the committed tip: the last
    committed position's node) or a row EARLIER in the same message, and its own id is new here
    (not live, not the tip, not the parent of a live node). Then no chain of parents can close
    into a loop: a loop needs a link into a new row, and only later rows of the same message may
    name one. Its position is its parent's + 1 (the tip's: `held`), so positions stay within the
    context the stage holds. `r` may be a RequestSlots or a view of one (kv/step_check.py).
    Returns each row's position and the committed tip (learned when it was unknown). Pure."""
    if not node_ids or len(parent_ids) != len(node_ids) or (positions is not None and len(positions) != len(node_ids)):
        raise RowsRefused(f"request {request_id}: {len(node_ids)} rows with {len(parent_ids)} parents"
                          + ("" if positions is None else f" and {len(positions)} positions"))
    tip, spec, sent = r.tip, r.spec, set(node_ids)
    referenced = {v[1] for v in spec.values()}  # ids the live nodes take as committed or live
    at: dict[int, int] = {}  # this message's rows -> position
    for i, (n, p) in enumerate(zip(node_ids, parent_ids)):
        if n in at or n in spec:
            raise RowsRefused(f"request {request_id}: node {n} computed twice at this stage")
        if n == NO_PARENT or n == tip or n in referenced:
            raise RowsRefused(f"request {request_id}: node {n} is already held here "
                              f"({'the committed tip' if n == tip else 'a live node names it as parent'}): "
                              "it cannot be declared again")
        if p in at:
            pos = at[p] + 1
        elif p in spec:
            pos = spec[p][2] + 1
        elif p in r.dropped:
            raise RowsRefused(f"request {request_id}: node {n} arrived after its parent {p} was pruned")
        elif p in sent:
            raise RowsRefused(f"request {request_id}: node {n}'s parent {p} comes after it in the message "
                              "(parents come first: a cycle otherwise)")
        elif p == tip or tip is None:
            tip, pos = p, r.held
        else:
            raise RowsRefused(f"request {request_id}: node {n}'s parent {p} is neither a node this stage holds "
                              f"(the committed tip {tip}, {len(spec)} live nodes) nor an earlier row")
        if positions is not None and positions[i] != pos:
            raise RowsRefused(f"request {request_id}: node {n} at position {positions[i]}, "
                              f"but its parent {p} is at {pos - 1}")
        at[n] = pos
    return [at[n] for n in node_ids], tip
