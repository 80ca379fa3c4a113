"""KV pool sizing from free memory leaves room for the weights the stages are about to hold."""

from __future__ import annotations

import dataclasses
import math

import pytest

from specpipe.config import EngineConfig, StageSpec
from specpipe.engine import kv_pool
from specpipe.loader import open_checkpoint

GIB = 1 << 30


def test_packed_gguf_holds_its_file_size(smollm2):
    config = EngineConfig(model=str(smollm2.path))
    held = kv_pool.held_weight_bytes(smollm2, config)
    # blocks stay packed on a CPU, on the native kernel or the portable one: the file's bytes
    assert held == smollm2.path.stat().st_size
    assert kv_pool.held_weight_bytes(smollm2, config, share=0.5) == held // 2


def test_quantization_counts_its_blocks(tiny_model_dir):
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    values = sum(math.prod(ckpt.shape(n)) for n in ckpt.names())
    assert kv_pool.held_weight_bytes(ckpt, EngineConfig(model=str(ckpt.path))) == 4 * values
    assert kv_pool.held_weight_bytes(ckpt, EngineConfig(model=str(ckpt.path), quantization="int8")) == \
        int(values * 34 / 32)


def test_weights_come_out_of_the_free_memory(monkeypatch, tiny_model_dir):
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    cfg = ckpt.config
    config = EngineConfig(model=str(ckpt.path), max_context=1 << 20, max_num_seqs=1 << 10)
    specs = [StageSpec(0, cfg.num_layers, True, True)]
    monkeypatch.setattr(kv_pool, "available_memory", lambda device: 4 * GIB)
    free = kv_pool.pool_blocks(config, cfg, specs, 0).blocks
    half = kv_pool.pool_blocks(config, cfg, specs, 0, weight_bytes=2 * GIB).blocks
    assert half == pytest.approx(free / 2, rel=0.01)
    assert kv_pool.pool_blocks(config, cfg, specs, 0, weight_bytes=8 * GIB).blocks == 1  # never below one


@pytest.mark.parametrize("mode, windowed", [("specpipe-db", True), ("pp-cb", True), ("pp", False), ("specpipe", False)])
def test_sliding_layers_get_a_pool_of_their_own_in_the_serving_modes(tiny_model_dir, mode, windowed):
    """Gemma 3's sliding layers keep only their window: their pool holds max_num_seqs windows and
    the rest of the memory goes to the global layers' pool, within the budget at every stage.
    Without a row budget a prompt enters whole, so every layer stays in the main pool."""
    cfg = open_checkpoint(tiny_model_dir("gemma3_text")).config
    config = EngineConfig(mode=mode, kv_memory="4MiB", max_context=4096, max_num_seqs=4)
    specs = [StageSpec(0, 1, True, False), StageSpec(1, cfg.num_layers, False, True)]  # all sliding | mixed
    pools = kv_pool.pool_blocks(config, cfg, specs, 9)
    per_layer_block = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * config.block_size
    if not windowed:
        assert pools.window_blocks == 0
        return
    assert 0 < pools.window_blocks < pools.blocks
    for s in specs:
        sliding = sum(cfg.is_sliding(i) for i in range(s.start, s.end))
        used = (pools.blocks * (s.end - s.start - sliding) + pools.window_blocks * sliding) * per_layer_block
        assert used <= 4 << 20
    without = kv_pool.pool_blocks(config, dataclasses.replace(cfg, sliding_layers=()), specs, 9)
    assert pools.blocks > without.blocks  # the memory the windows save goes to longer contexts
    assert pools.whole_blocks == without.blocks  # what a draft model's pool is sized by: as before
