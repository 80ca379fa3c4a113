"""The driver's count of KV blocks per request: admission and preemption decide on it.

Pure Python. The stages keep the real block tables (kv/slot_table.py); the driver mirrors
their rule without seeing them. A stage gives a request a new block only when all of the
request's slots are in use, and takes its blocks back only when it is released, so at any stage a
request holds ceil(peak slots / block_size) blocks. A request's slots at any stage never exceed
its *bound*: the tokens and tree nodes the driver has sent for it and not pruned (rows only
shrink on their way down the pipeline). So if the driver holds ceil(peak bound / block_size)
blocks for each request and never hands out more than the smallest stage pool, no stage can run
out. The bound counts speculative nodes as well as committed tokens.

Sliding-window layers keep their KV in a second pool at every stage, which forgets a request's
committed positions below P - window + 1, P being the committed prefix the stage has settled. The
driver does not know P at each stage, but it knows a lower bound, the request's *floor*: the
committed positions it sent S + 2 steps ago or earlier (engine/core.py), which every stage has
computed and settled by now. So a stage's window slots for a request never exceed
bound - max(0, floor - window + 1), and the driver holds blocks for the peak of that, as above.
"""

from __future__ import annotations

from typing import Optional


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def window_need(need: int, window: int, spec_reserve: int, num_stages: int, step_rows: Optional[int]) -> int:
    """The most window slots a request of `need` slots can be counted for: its last window of
    committed tokens, its tree, and the rows of the S + 2 steps its floor lags behind (at most
    `step_rows` a step; the whole prompt at once in the modes without a row budget)."""
    rows = need if step_rows is None else step_rows
    return min(need, window + spec_reserve + (num_stages + 2) * rows + 2)


class _Pool:
    """Blocks held per request, each monotone until the request is freed (the stages' rule)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held: dict[int, int] = {}
        self.spare = 0  # blocks admission keeps free (the scheduler's watermark)

    def num_free(self) -> int:
        return self.num_blocks - sum(self.held.values())

    def extra_for(self, request_id: int, tokens: int) -> int:
        return max(0, blocks_for(tokens, self.block_size) - self.held.get(request_id, 0))

    def room(self, request_id: int) -> int:
        """Slots the request may hold, leaving the spare blocks free."""
        return (self.held.get(request_id, 0) + self.num_free() - self.spare) * self.block_size

    def admissible(self) -> int:
        """The most slots one request can ever be admitted with (the pool above its spare blocks)."""
        return (self.num_blocks - self.spare) * self.block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: Optional[int] = None, window_blocks: int = 0) -> None:
        """`window`, `window_blocks`: the sliding-window layers' pool at every stage (none when
        the model has no such layers, or the stages keep them in the main pool)."""
        if num_blocks < 1 or block_size < 1 or (window and window_blocks < 1):
            raise ValueError(f"a KV pool needs at least one block of at least one slot, got "
                             f"{num_blocks} x {block_size} (window pool {window_blocks})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pool = _Pool(num_blocks, block_size)
        self.window = window if window_blocks else None
        self.window_pool = _Pool(window_blocks, block_size) if self.window else None
        self._floor: dict[int, int] = {}  # request -> committed positions every stage has settled

    @property
    def capacity(self) -> int:
        """Tokens (committed or speculative) the whole pool holds."""
        return self.num_blocks * self.block_size

    def keep_free(self, fraction: float) -> None:
        """Admission and speculation leave this share of each pool free (at least one block)."""
        for p in self.pools():
            p.spare = max(1, int(fraction * p.num_blocks)) if p.num_blocks > 1 else 0

    @property
    def watermark(self) -> int:
        return self.pool.spare

    def pools(self) -> list[_Pool]:
        return [self.pool] + ([self.window_pool] if self.window_pool is not None else [])

    def num_free(self) -> int:
        return self.pool.num_free()

    def held(self, request_id: int) -> int:
        return self.pool.held.get(request_id, 0)

    def set_floor(self, request_id: int, committed: int) -> None:
        """Every stage has settled the request's first `committed` positions (see the module)."""
        self._floor[request_id] = committed

    def _evictable(self, request_id: int) -> int:
        """Committed positions every stage's window table has forgotten for the request."""
        return max(0, self._floor.get(request_id, 0) - self.window + 1)

    def _tokens(self, request_id: int, tokens: int) -> list[int]:
        """`tokens` slots of the main pool, as slots of each pool."""
        if self.window_pool is None:
            return [tokens]
        return [tokens, tokens - self._evictable(request_id)]

    def fits(self, request_id: int, tokens: int, above_watermark: bool = False) -> bool:
        """Could the request hold `tokens` slots now (leaving the watermark free, if asked)?"""
        return all(p.extra_for(request_id, t) <= p.num_free() - (p.spare if above_watermark else 0)
                   for p, t in zip(self.pools(), self._tokens(request_id, tokens)))

    def room(self, request_id: int) -> int:
        """The most slots the request may hold, leaving the watermark free."""
        room = self.pool.room(request_id)
        if self.window_pool is not None:
            room = min(room, self.window_pool.room(request_id) + self._evictable(request_id))
        return room

    def admissible_tokens(self) -> int:
        """The most main-pool slots a request can ever be admitted with (above the watermark)."""
        return self.pool.admissible()

    def window_admissible_tokens(self) -> Optional[int]:
        return None if self.window_pool is None else self.window_pool.admissible()

    def reserve(self, request_id: int, tokens: int) -> None:
        """Grow the request's blocks so that `tokens` slots fit (never shrinks them)."""
        if not self.fits(request_id, tokens):
            raise RuntimeError(f"request {request_id}: more KV blocks needed for {tokens} slots than are free")
        for p, t in zip(self.pools(), self._tokens(request_id, tokens)):
            p.held[request_id] = p.held.get(request_id, 0) + p.extra_for(request_id, t)

    def free(self, request_id: int) -> None:
        for p in self.pools():
            p.held.pop(request_id, None)
        self._floor.pop(request_id, None)
