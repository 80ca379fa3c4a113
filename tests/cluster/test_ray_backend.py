"""RayBackend without a cluster: a failed placement is one PipelineError naming its cause, and the
KV pool and the stage count planned from node reports. The backend on a real cluster (hosts with
their own addresses, weights streamed, faults) is tests/cluster/test_hosts.py."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from specpipe.config import EngineConfig  # noqa: E402


@pytest.mark.parametrize("raised", ["actor", "cache"])
def test_a_failed_placement_is_a_pipeline_error_naming_its_cause(raised):
    """What recovery's start raises through Ray (a node agent lost while provisioning, a remote
    WeightCacheError) reaches engine/restart.py as one failed attempt with a one-line cause,
    not a remote traceback; no cluster needed."""
    from specpipe.cluster.ray_backend import RayBackend
    from specpipe.cluster.weights import WeightCacheError
    from specpipe.distributed.remote_pipeline import PipelineError

    backend = object.__new__(RayBackend)

    def fail():
        if raised == "actor":
            raise ray.exceptions.RayActorError()
        raise ray.exceptions.RayTaskError("finish", "Traceback (most recent call last):\n  ...",
                                          WeightCacheError("tiny.gguf: the stage bytes written hash to 00"))

    backend._start = fail
    with pytest.raises(PipelineError) as info:
        backend.start()
    text = str(info.value)
    assert "\n" not in text and text.startswith("placing the stages failed: ")
    assert ("died" in text) if raised == "actor" else ("WeightCacheError: tiny.gguf" in text)


def backend_on(nodes, monkeypatch, messages, **extra):
    """A RayBackend planned over `nodes` (NodeReports) without a cluster: joining, probing and
    calibrating are replaced by the reports given."""
    from specpipe.cluster import placement
    from specpipe.cluster.ray_backend import RayBackend
    from specpipe.engine.kv_pool import held_weight_bytes
    from specpipe.engine.stage_plan import cluster_blocks
    from specpipe.loader import open_checkpoint
    from specpipe.loader.default_model import default_model_path

    monkeypatch.setattr(placement, "connect", lambda address: None)
    monkeypatch.setattr(placement, "driver_node_id", lambda: "driver")
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(RayBackend, "_refresh_nodes", lambda self: self.reports.update({n.node_id: n for n in nodes}))
    path = default_model_path()
    ckpt = open_checkpoint(path)
    c = EngineConfig(model=str(path), cluster="ray", mode="specpipe", draft="ngram", **extra)
    return RayBackend(c, ckpt, path, lambda S: cluster_blocks(c, ckpt.config, S), held_weight_bytes(ckpt, c),
                      messages.append)


def test_the_kv_pool_is_a_share_of_free_memory_and_fewer_stages_are_said(smollm2, monkeypatch):
    """SmolLM2-135M on one node with 8 GiB free: the KV pool is --kv-memory-fraction of what the
    stage leaves free, as local stages get, not the 5.8 GB that --max-num-seqs full contexts
    could use; --stages 2 on one node plans one stage and says so."""
    from specpipe.cluster.planner import NodeReport

    GiB = 2**30
    messages: list[str] = []
    b = backend_on([NodeReport("n1", "node-1", 8 * GiB, 1.0, 2)], monkeypatch, messages, stages=2)
    cfg = smollm2.config
    kv = b.num_blocks * b.config.block_size * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    assert len(b.plan.stages) == 1 and kv <= 0.25 * 8 * GiB, kv / GiB  # was 5.67 GiB
    assert any("planned 1 stage, not the 2 --stages allows" in m and "--stage-layers" in m for m in messages)


def test_the_weight_chunk_option_wins_over_the_environment(monkeypatch):
    """--weight-chunk sets the streamed chunk (through the engine config); $SPECPIPE_WEIGHT_CHUNK
    is the fallback, then 8 MiB; a bad value is a ConfigError naming where it came from."""
    from specpipe.cluster.ray_backend import CHUNK_ENV, stream_chunk_bytes
    from specpipe.cluster.weights import CHUNK_BYTES
    from specpipe.config import ConfigError

    monkeypatch.delenv(CHUNK_ENV, raising=False)
    assert stream_chunk_bytes(None) == CHUNK_BYTES
    assert stream_chunk_bytes("256KiB") == 256 << 10
    monkeypatch.setenv(CHUNK_ENV, "1MiB")
    assert stream_chunk_bytes(None) == 1 << 20 and stream_chunk_bytes("64KiB") == 64 << 10
    monkeypatch.setenv(CHUNK_ENV, "lots")
    with pytest.raises(ConfigError, match=r"\$SPECPIPE_WEIGHT_CHUNK"):
        stream_chunk_bytes(None)
    assert stream_chunk_bytes("4KiB") == 4096  # the option is read first: a bad fallback is not looked at
    for bad, why in [("1KiB", "between 4 KiB and 1 GiB"), ("2GiB", "between 4 KiB and 1 GiB"),
                     ("fast", "cannot read 'fast'"), ("0", "cannot read '0'")]:
        with pytest.raises(ConfigError, match="--weight-chunk") as info:
            EngineConfig(cluster="ray", weight_chunk=bad).validate()
        assert why in str(info.value)


def test_the_backend_streams_in_the_configured_chunks(monkeypatch):
    """The engine config's weight_chunk reaches the backend that streams (no cluster needed)."""
    from specpipe.cluster.planner import NodeReport

    monkeypatch.setenv("SPECPIPE_WEIGHT_CHUNK", "1MiB")
    b = backend_on([NodeReport("n1", "node-1", 8 * 2**30, 1.0, 2)], monkeypatch, [], weight_chunk="256KiB")
    assert b.chunk_bytes == 256 << 10
    b = backend_on([NodeReport("n1", "node-1", 8 * 2**30, 1.0, 2)], monkeypatch, [])
    assert b.chunk_bytes == 1 << 20


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench"]])
def test_the_weight_options_are_on_every_command_that_takes_cluster_ray(command):
    from specpipe.entrypoints.cli import build_parser

    args = build_parser().parse_args([*command, "--cluster", "ray", "--weight-chunk", "256KiB",
                                      "--weight-cache-max", "40%"])
    assert (args.weight_chunk, args.weight_cache_max) == ("256KiB", "40%")
    if command[0] == "generate":
        from specpipe.entrypoints.cli import _engine_config

        config = _engine_config(args)
        assert (config.weight_chunk, config.weight_cache_max) == ("256KiB", "40%")
