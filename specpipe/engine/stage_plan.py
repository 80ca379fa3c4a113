"""The stages, planned once: which layers each holds and how many KV blocks it keeps, for every
way they start (in this process, local stage processes, torchrun ranks, Ray stage actors).

    --stages S + --stage-layers (8,8,7,7 | balanced | the even split) or the cluster planner's
    counts                                       -> split_layers: a StageSpec per stage (pure)
    + the mode's speculative reserve per request, --kv-memory or the free memory, and for one
      prompt (specpipe generate) that prompt's need  -> plan_stages: a StagePlan
    -> the driver starts the stages from it (start_pipeline.py); a torchrun stage rank plans the
       same and serves its own stage (start_pipeline.serve_stage_rank); the Ray backend (cluster/ray_backend.py)
       places the stages itself and takes its pool size from `cluster_blocks`

Glossary: *reserve* = the speculative rows (plus a new root) one request may hold at a stage at
once (core.spec_reserve); *pool* = a stage's KV blocks (kv_pool.py); *need* = the tokens one
request may hold, prompt + max tokens.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional, Sequence

from specpipe.config import ConfigError, EngineConfig, StageSpec, parse_bytes
from specpipe.costs.balance import resolve_stage_layers
from specpipe.costs.profile import CostProfile, load_profile
from specpipe.distributed.ranks import RankEnv, load_cluster_key
from specpipe.engine.core import spec_reserve
from specpipe.engine.kv_pool import KVPools, held_weight_bytes, pool_blocks
from specpipe.loader.checkpoint import Checkpoint
from specpipe.loader.partition import parse_stage_layers, partition_layers
from specpipe.sched.block_manager import BlockManager, blocks_for
from specpipe.sched.scheduler import Scheduler


class OnePrompt(NamedTuple):
    """The one request an engine is started for (specpipe generate): its pools hold it, no more."""

    prompt: str | Sequence[int]
    max_tokens: int
    chat: Optional[bool] = None


@dataclasses.dataclass(frozen=True)
class StagePlan:
    specs: tuple[StageSpec, ...]  # stage i holds layers [specs[i].start, specs[i].end)
    reserve: int  # speculative rows one request may hold at a stage
    pools: KVPools  # KV blocks per stage (every stage the same number)

    @property
    def layer_counts(self) -> list[int]:
        return [s.end - s.start for s in self.specs]


def split_layers(num_layers: int, stages: int, stage_layers: Optional[list[int] | str] = None,
                 profile: Optional[CostProfile] = None, mode: str = "pp", width: int = 1) -> list[StageSpec]:
    """The stages' layers, first stage first: `stage_layers` counts as given (--stage-layers, or
    the counts a cluster plan chose), None for the even split, or "balanced": counts whose
    slowest stage is fastest by the cost profile (costs/balance.py)."""
    counts = resolve_stage_layers(stage_layers, profile, num_layers, stages, mode, width)
    return partition_layers(num_layers, stages, counts)


def reserve_of(config: EngineConfig, stages: Optional[int] = None) -> int:
    return spec_reserve(config.mode, config.tree_width, config.tree_depth, stages or config.stages,
                        config.layers_per_step)


def plan_stages(config: EngineConfig, ckpt: Checkpoint, profile: Optional[CostProfile] = None,
                need: Optional[int] = None, sharing: Optional[int] = None,
                cluster_pool: Optional[int] = None) -> StagePlan:
    """The plan for `config` (for --cluster ray: the config the cluster plan returned, its counts
    in stage_layers, and the blocks per stage it sized, `cluster_pool`). `need`: the one request
    the engine is started for (specpipe generate), whose pool then holds that request and no
    more unless --kv-memory says otherwise; `sharing`: stages sharing this machine's memory (a
    torchrun rank: LOCAL_WORLD_SIZE), default all of them."""
    cfg = ckpt.config
    specs = split_layers(cfg.num_layers, config.stages, config.stage_layers, profile, config.mode, config.tree_width)
    reserve = reserve_of(config)
    if cluster_pool is not None:  # the cluster plan checked every node's memory for it
        return StagePlan(tuple(specs), reserve, KVPools(cluster_pool, 0, cluster_pool))
    share = 1.0 if sharing is None else min(1.0, sharing / len(specs))
    pools = pool_blocks(one_request(config, need, reserve), cfg, specs, reserve, sharing,
                        held_weight_bytes(ckpt, config, share))
    return StagePlan(tuple(specs), reserve, pools)


class ReportedPools(NamedTuple):
    """What the driver admits against once the stages have said what they hold."""

    blocks: int  # the main pool: the smallest any stage holds
    window_blocks: int  # the sliding-window pool: the smallest any stage that keeps one holds (0: none does)
    prefix_caching: bool  # cached blocks can be served: no stage keeps a sliding-window pool


def reported_pools(planned: KVPools, ready: Sequence[dict]) -> ReportedPools:
    """The pools of stages that sized their own (torchrun ranks: each from its machine's free
    memory), from every stage's readiness report (distributed/ranks.py READY_FIELDS); the main
    pool no larger than the driver's own plan either. Machines with different free memory may
    differ in whether they keep a sliding-window pool at all (kv_pool.pool_blocks); such a pool
    forgets old positions, so a cached prefix cannot be admitted there: prefix caching needs
    every stage without one, not the smallest report's 0."""
    windows = [r["window_blocks"] for r in ready if r["window_blocks"] > 0]
    return ReportedPools(min([planned.blocks] + [r["num_blocks"] for r in ready]),
                         min(windows, default=0), not windows)


def one_request(config: EngineConfig, need: Optional[int], reserve: int) -> EngineConfig:
    """The config a pool is sized by: for one request of `need` tokens (and no --kv-memory), a
    pool of exactly what admits it (blocks_admitting), instead of --max-num-seqs requests of
    --max-context tokens."""
    if need is None or config.kv_memory is not None:
        return config
    blocks = blocks_admitting(need + reserve, config.block_size)
    return dataclasses.replace(config, max_num_seqs=1, max_context=blocks * config.block_size - reserve)


def blocks_admitting(tokens: int, block_size: int) -> int:
    """The fewest blocks whose pool admits one request of `tokens` slots: its blocks plus the
    watermark the scheduler keeps free at admission (sched/scheduler.py, asked, not copied)."""
    n = blocks_for(tokens, block_size)
    while Scheduler(BlockManager(n, block_size), 1).blocks.admissible_tokens() < tokens:
        n += 1
    return n


def cluster_blocks(config: EngineConfig, cfg, stages: int, need: Optional[int] = None) -> int:
    """--cluster ray: blocks per stage before the split is known: what --max-num-seqs requests
    of --max-context tokens and their trees can use (or the one request of `need` tokens), or
    what --kv-memory buys a stage holding every layer, at most that; every layer in one pool."""
    import torch

    reserve = reserve_of(config, stages)
    if need is not None and config.kv_memory is None:
        return blocks_admitting(need + reserve, config.block_size)
    cap = config.max_num_seqs * blocks_for(config.max_context + reserve, config.block_size)
    if config.kv_memory is None:
        return cap
    dtype_bytes = torch.empty(0, dtype=config.torch_dtype()).element_size()
    per_layer_block = cfg.kv_values_per_token * dtype_bytes * config.block_size
    return max(1, min(cap, parse_bytes(config.kv_memory) // (per_layer_block * cfg.num_layers)))


def cost_profile_of(config: EngineConfig) -> Optional[CostProfile]:
    if config.cost_profile is None:
        return None
    try:
        return load_profile(config.cost_profile)
    except ValueError as e:
        raise ConfigError(f"--cost-profile: {e}") from None


def torchrun_rank() -> Optional[RankEnv]:
    """This process's rank in a torchrun job (None outside one): rank 0 drives, the others serve
    a stage each (start_pipeline.serve_stage_rank)."""
    return RankEnv.from_environ()


__all__ = ["OnePrompt", "StagePlan", "split_layers", "plan_stages", "blocks_admitting", "cluster_blocks", "reported_pools",
           "cost_profile_of", "torchrun_rank", "parse_stage_layers"]
