"""KV pool sizing from free memory leaves room for the weights the stages are about to hold."""

from __future__ import annotations

import math

import pytest

from specpipe.config import EngineConfig, StageSpec
from specpipe.engine import kv_pool
from specpipe.kernels import native
from specpipe.loader import open_checkpoint

GIB = 1 << 30


def test_packed_gguf_holds_its_file_size(smollm2):
    config = EngineConfig(model=str(smollm2.path))
    held = kv_pool.held_weight_bytes(smollm2, config)
    if native.available():  # blocks stay packed: the file's bytes
        assert held == smollm2.path.stat().st_size
    else:  # dequantized to float32 at load
        assert held == 4 * sum(math.prod(smollm2.shape(n)) for n in smollm2.names())
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
