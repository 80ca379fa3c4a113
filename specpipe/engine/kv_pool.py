"""How many KV blocks each stage gets: from memory, not from one request's context.

Every stage holds the same tokens (rows only shrink on their way down), so every stage gets the
same number of blocks: the fewest that any stage's memory allows, since the driver admits
requests against one pool. A stage with more layers needs more bytes per block.

  --kv-memory 2GiB              bytes for the KV cache of each stage
  --kv-memory-fraction 0.25     else: this share of the memory that stays free once the stages
                                on this machine (CPU) or this GPU hold their weights, split
                                among those stages

The pool is also capped at what `max_num_seqs` requests of `max_context` tokens plus their trees
can ever use, so a small model on a big machine does not reserve memory it never touches.

Sliding-window layers get a pool of their own, which keeps only each request's window
(`pool_blocks`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

import gguf

from specpipe.config import BUDGETED_MODES, EngineConfig, ModelConfig, StageSpec, parse_bytes
from specpipe.loader.checkpoint import Checkpoint
from specpipe.sched.block_manager import blocks_for, window_need
from specpipe.worker.memory import available_memory


def bytes_per_token(cfg: ModelConfig, spec: StageSpec, dtype_bytes: int) -> int:
    return (spec.end - spec.start) * cfg.kv_values_per_token * dtype_bytes


def held_weight_bytes(ckpt: Checkpoint, config: EngineConfig, share: float = 1.0) -> int:
    """Bytes the stages will hold for `share` of the model's weights once loaded (the memory a
    KV pool sized from free memory must leave them): a GGUF file's own size where its blocks stay
    packed, else every tensor at the activations' width (or --quantization's block size)."""
    import torch

    from specpipe.model.stage import QUANTIZATIONS, default_kernel

    path = Path(ckpt.path)
    if path.is_file() and default_kernel(config.device, config.quantization) != "float32":
        return int(path.stat().st_size * share)
    if config.quantization is not None:
        qtype = QUANTIZATIONS[config.quantization]
        values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        width = nbytes / values
    else:
        width = torch.empty(0, dtype=config.torch_dtype()).element_size()
    return int(sum(math.prod(ckpt.shape(n)) for n in ckpt.names()) * width * share)


class KVPools(NamedTuple):
    blocks: int  # the main pool's blocks per stage
    window_blocks: int = 0  # the sliding-window layers' own pool (0: they use the main pool)
    whole_blocks: int = 0  # the main pool had every layer been in it (what a draft model is sized by)


def pool_blocks(config: EngineConfig, cfg: ModelConfig, specs: list[StageSpec], spec_reserve: int,
                sharing: Optional[int] = None, weight_bytes: int = 0) -> KVPools:
    """Blocks per stage. `sharing`: stages sharing this machine's memory (default: all of them);
    `weight_bytes`: what those stages will hold in weights, not yet loaded (held_weight_bytes).

    A model with sliding-window layers (Gemma 3, Mistral) gets a second pool for them, sized for
    `max_num_seqs` requests' windows (sched/block_manager.window_need) so that it never limits
    how many requests run; the rest of the memory goes to the main pool, which holds whole
    contexts. Without a row budget (modes pp, tree, specpipe: a prompt enters at once) a window
    saves nothing, and every layer stays in the main pool."""
    import torch

    dtype_bytes = torch.empty(0, dtype=config.torch_dtype()).element_size()
    if config.kv_memory is not None:
        budget = parse_bytes(config.kv_memory)
    else:
        free = max(0, available_memory(config.device) - weight_bytes)
        budget = int(free * config.kv_memory_fraction / (sharing or len(specs)))
    bs = config.block_size
    need = config.max_context + spec_reserve
    per_request = blocks_for(need, bs)
    cap = config.max_num_seqs * per_request
    step_rows = config.max_step_rows if config.mode in BUDGETED_MODES else None
    per_block = max(bytes_per_token(cfg, s, dtype_bytes) for s in specs) * bs
    whole = int(max(1, min(budget // max(per_block, 1), cap)))
    if cfg.sliding_layers and cfg.sliding_window:
        per_window = blocks_for(window_need(need, cfg.sliding_window, spec_reserve, len(specs), step_rows), bs) + 1
        window_blocks = config.max_num_seqs * per_window
        sliding = [sum(cfg.is_sliding(i) for i in range(s.start, s.end)) for s in specs]
        per_layer = cfg.kv_values_per_token * dtype_bytes * bs  # bytes of one layer's block
        left = [budget - window_blocks * n * per_layer for n in sliding]
        blocks = min([cap] + [left_s // (per_layer * (s.end - s.start - n))
                              for s, n, left_s in zip(specs, sliding, left) if s.end - s.start > n])
        if per_window < per_request and min(left) > 0 and blocks > window_blocks:
            return KVPools(int(blocks), window_blocks, whole)
    return KVPools(whole, 0, whole)
