"""--cluster ray on a Ray cluster of several nodes on this machine (ray.cluster_utils.Cluster):
the same tokens as one process in every mode, weights streamed to a node that lacks the file
and loaded from its cache on the next run, a killed stage actor and a lost node survived token
for token. The head node offers no CPU, so stages go only to the three worker nodes; the third
ignores the driver's path (SPECPIPE_USE_SHARED_PATH=0), as a machine without the file would."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

ray = pytest.importorskip("ray")

import psutil  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from specpipe.config import EngineConfig  # noqa: E402
from specpipe.engine.engine import Engine  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402

PROMPTS = ["the theatre in the sea", "a b c a b c a b", "one two three four"]
PARAMS = [SamplingParams(max_tokens=24), SamplingParams(temperature=0.8, seed=3, max_tokens=24),
          SamplingParams(max_tokens=20)]
MODES = ("pp", "specpipe", "specpipe-db")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cache = tmp_path_factory.mktemp("node3-cache")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1), c.add_node(num_cpus=1),
             c.add_node(num_cpus=1, env_vars={"SPECPIPE_USE_SHARED_PATH": "0", "SPECPIPE_CACHE_DIR": str(cache)})]
    ray.init(address=c.address, log_to_driver=False)
    yield c, nodes, cache
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama", num_hidden_layers=6))


def config(model: str, mode: str, **extra) -> EngineConfig:
    draft = "ngram" if mode != "pp" else None
    return EngineConfig(model=model, mode=mode, draft=draft, tree_width=4, kv_memory="8MiB", max_context=128, **extra)


@pytest.fixture(scope="module")
def reference(model):
    """Every mode's tokens in one process."""
    engine = Engine(config(model, mode="specpipe", transport="inproc", stages=1))
    try:
        return {m: [engine.generate(p, s, chat=False, mode=m).token_ids for p, s in zip(PROMPTS, PARAMS)]
                for m in MODES}
    finally:
        engine.close()


def ray_engine(model, messages=None, **extra) -> Engine:
    return Engine(config(model, cluster="ray", **extra), progress=messages.append if messages is not None else None)


@pytest.mark.parametrize("stages", [2, 3])
def test_every_mode_gives_the_tokens_of_one_process(cluster, model, reference, stages):
    messages: list[str] = []
    # The counts fixed, so that every node holds a stage whatever the calibration saw (the
    # planner's own choices are tests/cluster/test_split_planner.py's).
    engine = ray_engine(model, messages, mode="specpipe", stages=stages, stage_layers=[6 // stages] * stages)
    try:
        assert engine.pipeline.num_stages == stages and len(engine.cluster.plan.stages) == stages
        assert any(m.startswith("plan (") for m in messages)  # printed before loading
        for mode in MODES:
            got = [engine.generate(p, s, chat=False, mode=mode).token_ids for p, s in zip(PROMPTS, PARAMS)]
            assert got == reference[mode], mode
    finally:
        engine.close()


def test_a_node_without_the_file_gets_its_stage_streamed_then_cached(cluster, model, reference):
    _, nodes, cache = cluster
    shutil.rmtree(cache / "weights", ignore_errors=True)  # what earlier tests of the module streamed there
    held = []  # per run: (stage, layers) that the file-less node holds
    for run in range(2):
        messages: list[str] = []
        engine = ray_engine(model, messages, mode="pp", stages=3, stage_layers=[2, 2, 2])  # a stage per node
        try:
            got = [engine.generate(p, s, chat=False).token_ids for p, s in zip(PROMPTS, PARAMS)]
            assert got == reference["pp"]
            stage = next(i for i, st in enumerate(engine.cluster.plan.stages, 1) if st.node.node_id == nodes[2].node_id)
            held.append((stage, engine.cluster.plan.stages[stage - 1].start))
        finally:
            engine.close()
        streamed = {m.split(":")[0] for m in messages if "streaming weights" in m and m.startswith("stage ")}
        if run == 0:
            assert streamed == {f"stage {held[0][0]}"}, messages  # only the node without the file
            assert list((cache / "weights").iterdir())
        elif held[1][1] == held[0][1]:
            assert streamed == set(), messages  # the same layers there again: from its cache
        else:  # calibration put other layers there: only those are new
            assert streamed == {f"stage {held[1][0]}"}, messages


def serve_and_kill(engine: Engine, kill, at_step: int = 5):
    core = engine.core()
    reqs = [engine.prompts.make_request(p, s, chat=False) for p, s in zip(PROMPTS, PARAMS)]
    for r in reqs:
        core.add_request(r)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        if steps == at_step:
            assert all(not r.finished for r in reqs)
            kill()
    return reqs


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_stage_actor_costs_no_token(cluster, model, reference, mode):
    # Two stages whatever the objective (pp's alone would put the whole small model on one node).
    engine = ray_engine(model, mode=mode, stages=2, stage_layers=[3, 3], stage_timeout_s=10)
    try:
        pids = engine.cluster.stage_pids()
        reqs = serve_and_kill(engine, lambda: os.kill(pids[1], signal.SIGKILL))
        assert [r.output_ids for r in reqs] == reference[mode]
        assert engine.core().stage_restarts == 1 and engine.cluster.restarts == 1
        assert engine.cluster.stage_pids()[1] != pids[1]
    finally:
        engine.close()


def lose_machine(c: Cluster, node) -> None:
    """A machine lost: its node leaves the cluster and every process it ran dies with it (Ray's
    workers outlive their raylet by seconds, long enough for a small model to finish unharmed)."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    workers = raylet.children(recursive=True)
    c.remove_node(node, allow_graceful=False)
    for w in workers:
        try:
            w.kill()
        except psutil.NoSuchProcess:
            pass


def test_a_lost_node_is_planned_around(cluster, model, reference):
    """Last: it takes a node away for good. Three stages on three nodes; one node goes; the
    split is planned again on the two left (one holds two stages) and no token differs."""
    c, nodes, _ = cluster
    engine = ray_engine(model, mode="specpipe-db", stages=3, stage_layers=[2, 2, 2], stage_timeout_s=10)
    try:
        used = {s.node.node_id for s in engine.cluster.plan.stages}
        assert len(used) == 3
        victim = next(n for n in nodes if n.node_id == engine.cluster.plan.stages[1].node.node_id)
        reqs = serve_and_kill(engine, lambda: lose_machine(c, victim))
        assert [r.output_ids for r in reqs] == reference["specpipe-db"]
        now = {s.node.node_id for s in engine.cluster.plan.stages}
        assert victim.node_id not in now and len(engine.cluster.plan.stages) == 3 and len(now) == 2
        placed = engine.placement()  # what /health and /metrics show
        # At least one restart (a second where Ray had not yet marked the node dead at the first)
        assert [st["state"] for st in placed] == ["running"] * 3 and len({st["restarts"] for st in placed}) == 1
        assert placed[0]["restarts"] >= 1
        assert {st["node_id"] for st in placed} == now
    finally:
        engine.close()


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
