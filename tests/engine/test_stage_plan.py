"""The stage plan (engine/stage_plan.py): layers per stage from --stages / --stage-layers / a
cluster plan, and the KV pool of `specpipe generate`'s one prompt."""

from __future__ import annotations

import pytest

from specpipe.cluster.planner import ModelBytes, NodeReport, plan_split
from specpipe.config import ConfigError, EngineConfig, StageSpec
from specpipe.engine import stage_plan
from specpipe.engine.core import spec_reserve
from specpipe.engine.engine import Engine
from specpipe.engine.kv_pool import pool_blocks
from specpipe.engine.stage_plan import OnePrompt
from specpipe.loader import open_checkpoint
from specpipe.sampling import SamplingParams
from specpipe.sched.block_manager import BlockManager
from specpipe.sched.scheduler import Scheduler


def counts(specs: list[StageSpec]) -> list[int]:
    return [s.end - s.start for s in specs]


# -- layers per stage (pure) ---------------------------------------------------------------------
def test_even_split_gives_the_remainder_to_the_first_stages():
    specs = stage_plan.split_layers(30, 4)
    assert counts(specs) == [8, 8, 7, 7]
    assert [(s.start, s.end) for s in specs] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [(s.first, s.last) for s in specs] == [(True, False), (False, False), (False, False), (False, True)]
    assert stage_plan.split_layers(30, 1) == [StageSpec(0, 30, True, True)]


def test_stage_layers_as_given():
    assert counts(stage_plan.split_layers(30, 3, [10, 15, 5])) == [10, 15, 5]
    assert counts(stage_plan.split_layers(30, 3, stage_plan.parse_stage_layers("4,20,6"))) == [4, 20, 6]


@pytest.mark.parametrize("stages, layers, why", [
    (3, [10, 10], "lists 2 stages"), (2, [10, 10], "sums to 20"), (2, [30, 0], "at least one layer"),
    (31, None, "more than the model"), (2, "balanced", "needs a --cost-profile")])
def test_bad_splits_are_refused(stages, layers, why):
    with pytest.raises(ConfigError, match=why):
        stage_plan.split_layers(30, stages, layers)


def test_a_cluster_plan_splits_as_the_engine_does():
    """The Ray backend hands the engine its planned counts (stage_layers); both make the same specs."""
    model = ModelBytes(tuple([100] * 12), 50, 50, 10, runtime_bytes=0)
    nodes = [NodeReport("a", "a", 10_000, 1.0), NodeReport("b", "b", 10_000, 3.0)]
    plan = plan_split(nodes, model, "throughput", stages=2)
    planned = [s.layers for s in plan.stages]
    assert planned != [6, 6]  # the faster node takes more layers: not the even split
    assert plan.specs() == stage_plan.split_layers(12, 2, planned)


def test_plan_of_a_config(tiny_model_dir):
    ckpt = open_checkpoint(tiny_model_dir("llama", num_hidden_layers=4))
    config = EngineConfig(model=str(ckpt.path), stages=3, mode="specpipe", tree_width=4, kv_memory="1MiB")
    plan = stage_plan.plan_stages(config, ckpt)
    assert plan.layer_counts == [2, 1, 1]
    assert plan.reserve == spec_reserve("specpipe", 4, 4, 3)
    assert plan.pools == pool_blocks(config, ckpt.config, list(plan.specs), plan.reserve)
    # --cluster ray: the cluster sized the pool, the counts came with the config
    clustered = stage_plan.plan_stages(EngineConfig(model=str(ckpt.path), stages=2, stage_layers=[3, 1]), ckpt,
                                       cluster_pool=7)
    assert clustered.layer_counts == [3, 1] and tuple(clustered.pools) == (7, 0, 7)


# -- the KV pool of one prompt (specpipe generate) -----------------------------------------------
def admits(blocks: int, tokens: int, block_size: int) -> bool:
    return blocks > 0 and Scheduler(BlockManager(blocks, block_size), 1).blocks.admissible_tokens() >= tokens


@pytest.mark.parametrize("tokens", [1, 16, 17, 60, 3000, 40_000])
def test_blocks_admitting_is_the_fewest_that_admit(tokens):
    n = stage_plan.blocks_admitting(tokens, 16)
    assert admits(n, tokens, 16) and not admits(n - 1, tokens, 16)


@pytest.mark.parametrize("mode, stages", [("pp", 1), ("pp", 2), ("tree", 1), ("specpipe", 3), ("specpipe-db", 2)])
def test_one_prompt_pool_holds_that_prompt(tiny_model_dir, mode, stages):
    ckpt = open_checkpoint(tiny_model_dir("llama", num_hidden_layers=4))
    config = EngineConfig(model=str(ckpt.path), mode=mode, stages=stages, tree_width=4, tree_depth=3)
    need = 27 + 16  # prompt + max tokens
    plan = stage_plan.plan_stages(config, ckpt, need=need)
    reserve = spec_reserve(mode, 4, 3, stages)
    assert plan.pools.blocks == stage_plan.blocks_admitting(need + reserve, config.block_size)
    assert plan.pools.blocks < stage_plan.plan_stages(config, ckpt).pools.blocks  # 32 whole contexts otherwise
    # --kv-memory given: the user's size, not the prompt's
    sized = EngineConfig(model=str(ckpt.path), mode=mode, stages=stages, tree_width=4, tree_depth=3,
                         kv_memory="64KiB")
    assert stage_plan.plan_stages(sized, ckpt, need=need).pools == stage_plan.plan_stages(sized, ckpt).pools
    # --cluster ray sizes its pool the same way
    assert stage_plan.cluster_blocks(config, ckpt.config, stages, need) == plan.pools.blocks


@pytest.mark.parametrize("family, mode", [("llama", "pp"), ("llama", "specpipe"), ("gemma3_text", "specpipe-db")])
def test_generate_for_one_prompt_gives_the_same_tokens(tiny_model_dir, family, mode):
    """The one prompt's pool gives the tokens of the whole pool (gemma3_text in specpipe-db:
    with its sliding-window layers' own pool)."""
    model = str(tiny_model_dir(family, num_hidden_layers=4))
    config = EngineConfig(model=model, mode=mode, stages=2, transport="inproc", tree_width=4, max_context=256)
    prompt, sampling = "the cat sat on the mat, the cat sat", SamplingParams(max_tokens=24)
    outs = []
    for one in (None, OnePrompt(prompt, sampling.max_tokens)):
        engine = Engine(config, one_prompt=one)
        try:
            out = engine.generate(prompt, sampling)
        finally:
            engine.close()
        outs.append((out.token_ids, engine.num_blocks))
    (whole_ids, whole_blocks), (one_ids, one_blocks) = outs
    assert one_ids == whole_ids and len(one_ids) == 24
    need = len(out.prompt_token_ids) + 24 + spec_reserve(mode, 4, 4, 2)
    assert one_blocks == stage_plan.blocks_admitting(need, config.block_size) < whole_blocks


# -- pools the stages report (torchrun: each rank sizes its own) ----------------------------------
def ready(num_blocks: int, window_blocks: int) -> dict:
    return {"num_blocks": num_blocks, "window_blocks": window_blocks}


def test_prefix_caching_needs_every_stage_without_a_window_pool():
    """Ranks on machines with different free memory: one keeps a sliding-window pool, another
    (short of memory for it) keeps every layer in its main pool. The smallest window report is
    0, yet a cached prefix could not be admitted at the first rank (KVStateError on
    admit(cached)): caching is off, and the driver admits within the window pool that exists."""
    from specpipe.engine.kv_pool import KVPools

    planned = KVPools(500, 0, 500)
    mixed = stage_plan.reported_pools(planned, [ready(300, 40), ready(200, 0)])
    assert mixed == (200, 40, False)
    assert stage_plan.reported_pools(planned, [ready(300, 40), ready(250, 24)]) == (250, 24, False)
    assert stage_plan.reported_pools(planned, [ready(300, 0), ready(600, 0)]) == (300, 0, True)
    # the driver's own plan bounds the main pool, but its window choice is no stage's
    assert stage_plan.reported_pools(KVPools(100, 16, 120), [ready(300, 0), ready(600, 0)]) == (100, 0, True)
