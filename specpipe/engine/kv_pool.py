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
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import gguf

from specpipe.config import EngineConfig, ModelConfig, StageSpec, parse_bytes
from specpipe.loader.checkpoint import Checkpoint


def bytes_per_token(cfg: ModelConfig, spec: StageSpec, dtype_bytes: int) -> int:
    return (spec.end - spec.start) * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def available_memory(device: str) -> int:
    """Bytes free now on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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


def pool_blocks(config: EngineConfig, cfg: ModelConfig, specs: list[StageSpec], spec_reserve: int,
                sharing: Optional[int] = None, weight_bytes: int = 0) -> int:
    """Blocks per stage. `sharing`: stages sharing this machine's memory (default: all of them);
    `weight_bytes`: what those stages will hold in weights, not yet loaded (held_weight_bytes)."""
    import torch

    dtype_bytes = torch.empty(0, dtype=config.torch_dtype()).element_size()
    if config.kv_memory is not None:
        budget = parse_bytes(config.kv_memory)
    else:
        free = max(0, available_memory(config.device) - weight_bytes)
        budget = int(free * config.kv_memory_fraction / (sharing or len(specs)))
    per_block = max(bytes_per_token(cfg, s, dtype_bytes) for s in specs) * config.block_size
    blocks = budget // max(per_block, 1)
    per_request = -(-(config.max_context + spec_reserve) // config.block_size)
    return int(max(1, min(blocks, config.max_num_seqs * per_request)))
