"""Which full KV blocks hold which tokens: the driver's index of the prefix cache.

A full block of `block_size` committed positions is named by its *content*: its parent block
(the one before it in the sequence, None for a sequence's first) and its token ids. The key is
that pair, kept whole in a dict, so a lookup hashes it (a hash chained through the parents' keys)
and then compares the tokens: a hit is never decided by a hash alone. Two requests that computed
the same tokens after the same prefix hold the same KV, so the second can reuse the first's
block at every stage instead of computing it again.

Each cached block gets a small id that never comes back; the stages know their blocks by it
(kv/cached_blocks.py), since the block ids of the stages' pools differ from stage to stage. A
block is *referenced* while a request reads it; an unreferenced one stays cached in an LRU and
is evicted only when a request needs its space (its id then goes to the stages with the next
step, before any rows that could need it). A request's blocks join the LRU last block first, so a
sequence's tail is evicted before its head and a shorter prefix of it stays usable.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass(eq=False)
class CachedBlock:
    block_id: int
    key: tuple  # (parent's block_id or None, tokens)
    refs: int = 0


@dataclass
class PrefixCacheStats:
    """Counters in vLLM's terms: prompt tokens looked up, and of those, found in the cache."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


@dataclass
class PrefixCache:
    block_size: int
    blocks: dict[tuple, CachedBlock] = field(default_factory=dict)  # key -> block
    lru: "OrderedDict[int, CachedBlock]" = field(default_factory=OrderedDict)  # unreferenced, oldest first
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    evicted: list[int] = field(default_factory=list)  # ids evicted that the stages have not been told of
    _ids: itertools.count = field(default_factory=itertools.count)

    def __len__(self) -> int:
        """Blocks cached (referenced or not): pool blocks the cache holds."""
        return len(self.blocks)

    def evictable(self) -> int:
        return len(self.lru)

    def match(self, tokens: Sequence[int], limit: int) -> list[CachedBlock]:
        """The cached blocks that hold `tokens`' first positions, at most `limit` tokens' worth."""
        out: list[CachedBlock] = []
        parent: Optional[int] = None
        bs = self.block_size
        for k in range(min(limit, len(tokens)) // bs):
            block = self.blocks.get((parent, tuple(tokens[k * bs:(k + 1) * bs])))
            if block is None:
                break
            out.append(block)
            parent = block.block_id
        return out

    def count_query(self, tokens: int, hit: int) -> None:
        self.stats.queries += tokens
        self.stats.hits += hit

    def acquire(self, blocks: Sequence[CachedBlock]) -> None:
        for b in blocks:
            b.refs += 1
            self.lru.pop(b.block_id, None)

    def release(self, blocks: Sequence[CachedBlock]) -> None:
        """A request stopped reading these (in sequence order); the unreferenced ones join the
        LRU tail first."""
        for b in reversed(blocks):
            b.refs -= 1
            if b.refs == 0:
                self.lru[b.block_id] = b

    def insert(self, parent: Optional[CachedBlock], tokens: Sequence[int]) -> tuple[CachedBlock, bool]:
        """Cache a block of `tokens` after `parent`, referenced once (by the request that
        computed it). Returns (block, new): when the same content is cached already, that block
        and False (the caller's copy is not needed; nothing is referenced)."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached: {len(tokens)} tokens, block size {self.block_size}")
        key = (None if parent is None else parent.block_id, tuple(int(t) for t in tokens))
        found = self.blocks.get(key)
        if found is not None:
            return found, False
        block = CachedBlock(next(self._ids), key, refs=1)
        self.blocks[key] = block
        return block, True

    def evict(self, n: int) -> None:
        """Forget up to `n` unreferenced blocks, least recently used first. Their ids wait in
        `evicted` for the next step (of whichever engine core runs the stages next)."""
        while self.lru and n > 0:
            _, b = self.lru.popitem(last=False)
            del self.blocks[b.key]
            self.evicted.append(b.block_id)
            self.stats.evictions += 1
            n -= 1

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    def chain(self) -> "PrefixChain":
        """A new request's place in this cache (none yet)."""
        return PrefixChain(self)

    def clear(self) -> None:
        """Forget everything (the stages were started afresh and hold none of it)."""
        self.blocks.clear()
        self.lru.clear()
        self.evicted = []


class PrefixChain:
    """One request's place in a PrefixCache: the cached block for each of its first blocks
    (`chain`: its own or an equal one), and those it holds a reference to (`refs`). The one way a
    request reads and adds cached blocks, for the stages' block manager (sched/block_manager.py)
    and the draft model's cache (spec_decode/draft_prefix.py, which gets it from the index it is
    handed: `PrefixCache.chain`) alike."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.chain: list[CachedBlock] = []
        self.refs: list[CachedBlock] = []

    def read(self, tokens: Sequence[int], limit: int) -> list[CachedBlock]:
        """Before the request's first rows: its longest cached prefix, at most `limit` tokens."""
        hit = self.cache.match(tokens, limit)
        self.cache.acquire(hit)
        self.chain, self.refs = list(hit), list(hit)
        return hit

    def add(self, tokens: Sequence[int]) -> Optional[CachedBlock]:
        """The request's next full block holds `tokens`: cache it. Returns the new block, or None
        when equal content was cached already (the request keeps its copy as its own and chains
        on from the cached one)."""
        block, new = self.cache.insert(self.chain[-1] if self.chain else None, tokens)
        self.chain.append(block)
        if not new:
            return None
        self.refs.append(block)
        return block

    def release(self) -> None:
        """The request stops reading its cached blocks (they stay cached, unreferenced)."""
        self.cache.release(self.refs)
        self.chain, self.refs = [], []
