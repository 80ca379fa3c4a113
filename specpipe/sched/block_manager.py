"""The driver's count of KV blocks per request: admission and preemption decide on it.

Pure Python. The stages keep the real block tables (kv/slot_table.py); the driver mirrors
their rule without seeing them. A stage gives a request a new block only when all of the
request's slots are in use, and takes its blocks back only when it is released, so at any stage a
request holds ceil(peak slots / block_size) blocks. A request's slots at any stage never exceed
its *bound*: the tokens and tree nodes the driver has sent for it and not pruned (rows only
shrink on their way down the pipeline). So if the driver holds ceil(peak bound / block_size)
blocks for each request and never hands out more than the smallest stage pool, no stage can run
out. The bound counts speculative nodes as well as committed tokens.
"""

from __future__ import annotations


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one slot, got "
                             f"{num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._held: dict[int, int] = {}  # request -> blocks held (monotone until freed)

    @property
    def capacity(self) -> int:
        """Tokens (committed or speculative) the whole pool holds."""
        return self.num_blocks * self.block_size

    def num_free(self) -> int:
        return self.num_blocks - sum(self._held.values())

    def held(self, request_id: int) -> int:
        return self._held.get(request_id, 0)

    def extra_for(self, request_id: int, tokens: int) -> int:
        """Blocks the request still needs so that `tokens` slots fit."""
        return max(0, blocks_for(tokens, self.block_size) - self.held(request_id))

    def can_hold(self, request_id: int, tokens: int) -> bool:
        return self.extra_for(request_id, tokens) <= self.num_free()

    def reserve(self, request_id: int, tokens: int) -> None:
        """Grow the request's blocks so that `tokens` slots fit (never shrinks them)."""
        extra = self.extra_for(request_id, tokens)
        if extra > self.num_free():
            raise RuntimeError(f"request {request_id}: {extra} more KV blocks needed, {self.num_free()} free")
        if extra or request_id not in self._held:
            self._held[request_id] = self.held(request_id) + extra

    def free(self, request_id: int) -> None:
        self._held.pop(request_id, None)
