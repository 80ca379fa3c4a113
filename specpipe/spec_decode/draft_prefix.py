"""The draft model's prefix cache: the stages' scheme (sched/prefix_cache.py, kv/slot_table.py),
driven in place, since the draft runs in the driver's process and computes its rows at once. The
index is the driver's kind, handed in by the engine (this room sits below sched/).

A request's first rows (its prompt, from position 0) skip the blocks the index holds; its full
blocks of committed tokens join the cache as they settle where its rows filled them in order, and
the rest at its end (copied into whole blocks where a tree scattered them). When the pool is short
of blocks for a step's rows, the least recently used unreferenced blocks go first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from specpipe.kv.slot_table import SlotTable
from specpipe.spec_decode.sources import SourceRows


@dataclass
class _Request:
    cached: Any  # sched.prefix_cache.PrefixChain: its blocks in the index (from `index.chain()`)
    commits: list[int] = field(default_factory=list)  # committed node ids, in position order
    tokens: dict[int, int] = field(default_factory=dict)  # node id -> token, for rows fed
    scattered: bool = False  # a block its rows did not fill in order: the rest waits for its end


class DraftPrefixCache:
    def __init__(self, slots: SlotTable, move: Callable[[list[tuple[int, int]]], None], index) -> None:
        """`move`: copies KV slots (from, to) in the draft's KV tensors; `index`: an empty
        sched.prefix_cache.PrefixCache of the table's block size."""
        self.slots, self.move, self.index = slots, move, index
        self.requests: dict[int, _Request] = {}

    def _request(self, pid: int) -> _Request:
        if pid not in self.requests:
            self.requests[pid] = _Request(self.index.chain())
        return self.requests[pid]

    def observe(self, pid: int, commit: Sequence[int], drop: Sequence[int]) -> None:
        r = self._request(pid)
        r.commits.extend(commit)
        for n in drop:
            r.tokens.pop(n, None)

    def feed(self, pid: int, rows: SourceRows, want: Sequence[int]) -> SourceRows:
        """The rows of a call, less those a cached prefix already holds (a fresh request's prompt)."""
        r = self._request(pid)
        r.tokens.update(zip(rows.node_ids, rows.tokens.tolist()))
        table = self.slots.requests.get(pid)
        if (table is None or table.failed or table.committed or table.spec or not rows.node_ids
                or rows.positions[0] != 0):
            return rows
        want = set(want)
        limit = min([len(rows.node_ids) - 1] + [i for i, n in enumerate(rows.node_ids) if n in want])
        hit = r.cached.read(rows.tokens.tolist(), limit)
        self.index.count_query(len(rows.node_ids), len(hit) * self.slots.block_size)
        if not hit:
            return rows
        self.slots.adopt(pid, [b.block_id for b in hit])
        h = len(hit) * self.slots.block_size
        return SourceRows(rows.node_ids[h:], rows.parent_ids[h:], rows.positions[h:], rows.tokens[h:])

    def make_room(self, blocks: int) -> None:
        """Evict cached blocks until `blocks` are free (as many as nobody reads)."""
        short = blocks - self.slots.pool.num_free()
        if short > 0:
            self.index.evict(short)
            self.slots.evict(self.index.take_evicted())

    def available(self) -> int:
        return self.slots.pool.num_free() + self.index.evictable()

    def share(self, pid: int, final: bool = False) -> None:
        """Cache the request's full blocks that have settled (every one at its end), all in one
        SlotTable.share: a block a tree scattered is copied into a spare block of the request,
        which may hold another block's sources, so every copy reads before any writes."""
        r, table = self.requests.get(pid), self.slots.requests.get(pid)
        if r is None or table is None or table.failed or (r.scattered and not final):
            return
        bs = self.slots.block_size
        runs, ids = [], []
        for k in range(len(r.cached.chain), len(table.committed) // bs):
            nodes = r.commits[k * bs:(k + 1) * bs]
            if any(n not in r.tokens for n in nodes):
                break
            if not final and self.slots.whole_block(pid, k) is None:
                r.scattered = True  # not one block's slots in order: at its end, then
                break
            block = r.cached.add([r.tokens[n] for n in nodes])
            if block is not None:
                runs.append(k)
                ids.append(block.block_id)
        if runs:
            moves = self.slots.share(pid, runs, ids, final=final)
            if moves:
                self.move(moves)

    def finish(self, pid: int) -> None:
        self.share(pid, final=True)
        r = self.requests.pop(pid, None)
        if r is not None:
            r.cached.release()
