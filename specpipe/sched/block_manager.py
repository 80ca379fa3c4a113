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

Prefix caching (sched/prefix_cache.py; main pool only): blocks the cache holds count once,
whichever requests read them; a request's own blocks are those it does not share, so it holds
ceil((peak bound - shared tokens) / block_size) of them. Unreferenced cached blocks are free to
take: `reserve` evicts the least recently used as it needs them, and `take_evicted` hands their
ids to the engine, which tells the stages with the next step.
"""

from __future__ import annotations

from typing import Optional, Sequence

from specpipe.sched.prefix_cache import PrefixCache, PrefixChain


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

    def __init__(self, num_blocks: int, block_size: int, cache: Optional[PrefixCache] = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held: dict[int, int] = {}  # request -> blocks of its own (not in the cache)
        self.shared: dict[int, int] = {}  # request -> its slots in cached blocks
        self.spare = 0  # blocks admission keeps free (the scheduler's watermark)
        self.cache = cache

    def num_free(self) -> int:
        """Blocks neither a request nor the cache holds."""
        return self.num_blocks - sum(self.held.values()) - (len(self.cache) if self.cache is not None else 0)

    def available(self) -> int:
        """Blocks a request could take now: the free ones and the cached ones nobody reads."""
        return self.num_free() + (self.cache.evictable() if self.cache is not None else 0)

    def extra_for(self, request_id: int, tokens: int) -> int:
        own = tokens - self.shared.get(request_id, 0)
        return max(0, blocks_for(own, self.block_size) - self.held.get(request_id, 0))

    def room(self, request_id: int) -> int:
        """Slots the request may hold, leaving the spare blocks free."""
        return ((self.held.get(request_id, 0) + self.available() - self.spare) * self.block_size
                + self.shared.get(request_id, 0))

    def admissible(self) -> int:
        """The most slots one request can ever be admitted with (the pool above its spare blocks)."""
        return (self.num_blocks - self.spare) * self.block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: Optional[int] = None, window_blocks: int = 0,
                 cache: Optional[PrefixCache] = None) -> None:
        """`window`, `window_blocks`: the sliding-window layers' pool at every stage (none when
        the model has no such layers, or the stages keep them in the main pool).
        `cache`: the prefix cache of the stages' pools, which keeps full blocks of committed
        tokens for later requests (not with a sliding-window pool, which forgets what its window
        has passed); shared by every engine core of one set of stages."""
        if num_blocks < 1 or block_size < 1 or (window and window_blocks < 1):
            raise ValueError(f"a KV pool needs at least one block of at least one slot, got "
                             f"{num_blocks} x {block_size} (window pool {window_blocks})")
        if cache is not None and ((window and window_blocks) or cache.block_size != block_size):
            raise ValueError("prefix caching needs every layer in the main KV pool (no sliding-window pool) "
                             "and the pool's block size")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.cache = cache
        self.pool = _Pool(num_blocks, block_size, self.cache)
        self._chains: dict[int, PrefixChain] = {}  # request -> its cached blocks
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
        return all(p.extra_for(request_id, t) <= p.available() - (p.spare if above_watermark else 0)
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
            extra = p.extra_for(request_id, t)
            if extra > p.num_free():
                self.cache.evict(extra - p.num_free())
            p.held[request_id] = p.held.get(request_id, 0) + extra

    def free(self, request_id: int) -> None:
        """The request holds nothing any more (its cached blocks stay cached, unreferenced)."""
        for p in self.pools():
            p.held.pop(request_id, None)
        self.pool.shared.pop(request_id, None)
        self._floor.pop(request_id, None)
        chain = self._chains.pop(request_id, None)
        if chain is not None:
            chain.release()

    # -- prefix caching ------------------------------------------------------------------------------
    def lookup(self, request_id: int, tokens: Sequence[int]) -> list[int]:
        """Before a request's first rows: read its longest cached prefix (leaving at least one
        token to compute, so that there are logits for the next). Returns the cached blocks'
        ids, in order; the request's prefill starts after them."""
        if self.cache is None:
            return []
        self.free(request_id)  # an earlier lookup for it, if it then waited
        hit = self._chains.setdefault(request_id, self.cache.chain()).read(tokens, len(tokens) - 1)
        self.pool.shared[request_id] = len(hit) * self.block_size
        return [b.block_id for b in hit]

    def cached_blocks(self, request_id: int) -> int:
        """How many of the request's first blocks are known to the cache (its or an equal one)."""
        chain = self._chains.get(request_id)
        return len(chain.chain) if chain is not None else 0

    def share(self, request_id: int, tokens: Sequence[int]) -> Optional[int]:
        """The request's next full block (after `cached_blocks`) holds `tokens`, computed at every
        stage: cache it. Returns its new block id, or None when equal content was cached already
        (the request keeps its copy as its own, and chains on from the cached one)."""
        block = self._chains.setdefault(request_id, self.cache.chain()).add(tokens)
        if block is None:
            return None
        self.pool.held[request_id] -= 1  # its own block is the cache's now
        self.pool.shared[request_id] = self.pool.shared.get(request_id, 0) + self.block_size
        return block.block_id

    def take_evicted(self) -> list[int]:
        """Cached blocks evicted since the last call: the stages free them with the next step."""
        return self.cache.take_evicted() if self.cache is not None else []

    def clear_cache(self) -> None:
        """The stages hold no cached block any more (started afresh). Call with no request running."""
        if self.cache is not None:
            self.cache.clear()
