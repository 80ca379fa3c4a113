"""--cluster ray on hosts with addresses of their own: three network namespaces on a bridge, a Ray
worker node in each (tests/netns_helpers.py), the driver (this process) beside a head node that
offers no CPU. Every node has its own cache and ignores the driver's model path
(SPECPIPE_USE_SHARED_PATH=0), so every stage's weights are streamed to it, in 256 KiB chunks
(--weight-chunk): the embedded SmolLM2's stages span dozens of chunks.

  * S = 2 and 3 give one process's tokens in pp, specpipe and specpipe-db; the links between the
    hosts are measured and printed with the plan.
  * A transfer cut off when its node's agent dies resumes from the chunks that landed.
  * Faults that hosts have and processes do not, each survived token for token: a host frozen
    (SIGSTOP on all its processes, resumed once the pipeline has restarted without it: its late
    frames must not reach the new pipeline), a host partitioned (its link down: frames vanish),
    a host lost for good (its processes killed): the split is planned again on the hosts left.
    The host that left is never in the new plan.

Cost: about 0.5 GB and a few seconds of CPU per Ray node; the module takes some minutes on two
cores (see docs/cluster.md and docs/benchmarks.md §6).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from netns_helpers import Hosts, NamespacesUnavailable, RayHosts  # noqa: E402

from specpipe.config import EngineConfig  # noqa: E402
from specpipe.engine.engine import Engine  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402

PROMPTS = ["the theatre in the sea", "a b c a b c a b"]
PARAMS = [SamplingParams(max_tokens=10), SamplingParams(temperature=0.8, seed=3, max_tokens=10)]
MODES = ("pp", "specpipe", "specpipe-db")
CHUNK = 256 << 10
STAGE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """(Hosts, RayHosts), this process joined to the cluster as its driver."""
    try:
        net = Hosts(3)
    except NamespacesUnavailable as e:
        pytest.skip(str(e))
    rh = None
    try:
        rh = RayHosts(net, tmp_path_factory.mktemp("hosts"))
        ray.init(address=rh.address, _node_ip_address=net.bridge_address, log_to_driver=False)
        yield net, rh
    finally:
        ray.shutdown()
        if rh is not None:
            rh.close()
        net.close()


@pytest.fixture(scope="module")
def model():
    from specpipe.loader.default_model import DefaultModelMissing, default_model_path

    try:
        return str(default_model_path())
    except DefaultModelMissing as e:
        pytest.skip(f"the default model is not installed: {e}")


def config(model: str, mode: str, **extra) -> EngineConfig:
    return EngineConfig(model=model, mode=mode, draft="ngram" if mode != "pp" else None, tree_width=4,
                        kv_memory="16MiB", max_context=128, **extra)


@pytest.fixture(scope="module")
def reference(model):
    """Every mode's tokens in one process."""
    engine = Engine(config(model, mode="specpipe", transport="inproc", stages=1))
    try:
        return {m: [engine.generate(p, s, chat=False, mode=m).token_ids for p, s in zip(PROMPTS, PARAMS)]
                for m in MODES}
    finally:
        engine.close()


def ray_engine(model, messages, **extra) -> Engine:
    return Engine(config(model, cluster="ray", weight_chunk="256KiB", **extra), progress=messages.append)


def host_of(net: Hosts, node_name: str):
    """The host whose address the plan's node name starts with (RayBackend._name: ip/node id)."""
    return next(h for h in net.hosts if node_name.split("/")[0] == h.address)


@pytest.mark.parametrize("stages", [2, 3])
def test_every_mode_gives_the_tokens_of_one_process(hosts, model, reference, stages):
    net, rh = hosts
    messages: list[str] = []
    counts = [30 // stages] * stages  # SmolLM2's 30 layers; the counts fixed, so every host used
    engine = ray_engine(model, messages, mode="specpipe", stages=stages, stage_layers=counts)
    try:
        placed = [host_of(net, s.node.name) for s in engine.cluster.plan.stages]
        node_ids = [s.node.node_id for s in engine.cluster.plan.stages]
        specs = engine.cluster.plan.specs()
        assert engine.pipeline.num_stages == stages and len(set(h.ns for h in placed)) == stages
        for mode in MODES:
            got = [engine.generate(p, s, chat=False, mode=mode).token_ids for p, s in zip(PROMPTS, PARAMS)]
            assert got == reference[mode], mode
    finally:
        engine.close()
    text = "\n".join(messages)
    # The links measured (every pair, the driver's too) and printed with the plan.
    assert text.count(" Mbit/s") >= 2 * stages and "link driver -> " in text, text
    assert "  back to the driver: " in text
    # No host has the file at the driver's path (as far as SpecPipe may know): each stage's bytes
    # went to its host in many chunks, each checked as it landed, into the host's own cache.
    for i, h in enumerate(placed):
        total = next(m for m in messages if m.startswith(f"weights to node {h.address}/") and f"stage {i + 1}" in m)
        if "resuming" not in total:
            mib = float(total.rsplit(": ", 1)[1].split(" MiB")[0])
            assert mib * 2**20 > 8 * CHUNK, total
    # The next run finds every stage in its host's cache, verified there (what find() answers is
    # what a new pipeline opens): nothing to stream again.
    from specpipe.cluster.node_agent import NodeAgent
    from specpipe.cluster.placement import on_node
    from specpipe.cluster.weights import stage_digest
    from specpipe.loader import open_checkpoint

    ckpt, agent_cls = open_checkpoint(model), ray.remote(num_cpus=0)(NodeAgent)
    for h, nid, spec in zip(placed, node_ids, specs):
        sb = ckpt.stage_ranges(spec)
        agent = agent_cls.options(**on_node(nid)).remote()
        try:
            found = ray.get(agent.find.remote(sb, stage_digest(sb.root_of(model), sb), model))
        finally:
            ray.kill(agent)
        assert found and found.startswith(str(rh.caches[h.ns] / "weights")), (h, found)


def test_a_transfer_cut_off_resumes_from_what_landed(hosts, model):
    """A node agent killed while a stage streams to it (as when its host dies: its process and
    its writer's lock go, the chunks that landed stay); a new agent on that node resumes: only the
    rest is sent, and the entry verifies."""
    from specpipe.cluster.node_agent import NodeAgent
    from specpipe.cluster.placement import live_nodes, on_node
    from specpipe.cluster.streaming import Transfer, stream
    from specpipe.cluster.weights import stage_digest
    from specpipe.config import StageSpec
    from specpipe.loader import open_checkpoint

    net, rh = hosts
    host = net.hosts[0]
    nid = next(n["NodeID"] for n in live_nodes() if n["NodeManagerAddress"] == host.address)
    sb = open_checkpoint(model).stage_ranges(StageSpec(3, 9, False, False))  # not a stage of the other tests
    root = sb.root_of(model)
    digest = stage_digest(root, sb)
    agent_cls = ray.remote(num_cpus=0, max_concurrency=8)(NodeAgent)

    def transfer(agent) -> Transfer:
        return Transfer(host.address, "layers 3-8", agent, sb, digest, root)

    first = agent_cls.options(**on_node(nid)).remote()
    pid = ray.get(first.__ray_call__.remote(lambda self: os.getpid()))
    killed = threading.Event()

    def on_line(line: str) -> None:
        if "%" in line and not killed.is_set() and int(line.split("%")[0].split()[-1]) >= 30:
            killed.set()
            os.kill(pid, 9)

    with pytest.raises(Exception):  # noqa: B017 (Ray's error for a dead actor, whichever it is)
        stream([transfer(first)], CHUNK, progress=on_line)
    assert killed.is_set()
    lines: list[str] = []
    second = agent_cls.options(**on_node(nid)).remote()
    try:
        [path] = stream([transfer(second)], CHUNK, progress=lines.append)
        assert ray.get(second.find.remote(sb, digest, model)) == path
    finally:
        ray.kill(second)
    start = next(m for m in lines if "resuming: " in m)
    resumed = float(start.split("resuming: ")[1].split(" MiB")[0]) * 2**20
    done = next(m for m in lines if ": done, " in m)
    sent = float(done.split("done, ")[1].split(" MiB")[0]) * 2**20
    assert resumed >= 0.2 * sb.total and sent <= sb.total - resumed + CHUNK, lines


def serve_with_fault(engine: Engine, fault, after=None, at_step: int = 4):
    """Every prompt at once; `fault()` at step `at_step`; `after()` once the pipeline has been
    started again. The requests, for their tokens."""
    core = engine.core()
    reqs = [engine.prompts.make_request(p, s, chat=False) for p, s in zip(PROMPTS, PARAMS)]
    for r in reqs:
        core.add_request(r)
    steps, done_after = 0, after is None
    while core.has_work():
        core.step()
        steps += 1
        if steps == at_step:
            assert all(not r.finished for r in reqs)
            fault()
        if not done_after and core.stage_restarts >= 1:
            after()
            done_after = True
    if not done_after:
        after()
    return reqs


def fault_run(hosts, model, reference, mode, fault, after=None, standby: bool = False) -> Engine:
    """A two-stage pipeline over two hosts, the fault applied to the host of stage 2; the tokens
    equal one process's, the pipeline restarted without that host, with the same layer counts.
    standby: first wait for every node's standby stage actor, and check the restart took them."""
    net, rh = hosts
    messages: list[str] = []
    engine = ray_engine(model, messages, mode=mode, stages=2, stage_layers=[15, 15],
                        stage_timeout_s=STAGE_TIMEOUT_S)
    try:
        victim = host_of(net, engine.cluster.plan.stages[1].node.name)
        if standby:
            deadline = time.monotonic() + 60
            while len(engine.cluster._standby) < len(net.hosts) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert len(engine.cluster._standby) == len(net.hosts)
        t0 = time.monotonic()
        reqs = serve_with_fault(engine, lambda: fault(victim), after and (lambda: after(victim)))
        assert [r.output_ids for r in reqs] == reference[mode], messages
        assert engine.core().stage_restarts >= 1
        assert all(host_of(net, s.node.name) is not victim for s in engine.cluster.plan.stages)
        assert [s.layers for s in engine.cluster.plan.stages] == [15, 15]  # --stage-layers kept
        assert time.monotonic() - t0 < 120
        if standby:  # the new stages came from the standbys (no new Ray worker process to wait for)
            assert any(m.startswith("restart 1: stages up in ") and "(2 standby)" in m for m in messages), messages
        return engine
    finally:
        engine.close()


def test_a_frozen_host_is_planned_around_and_its_late_frames_refused(hosts, model, reference):
    """SIGSTOP on every process of a stage's host: silence past --stage-timeout, its agent does
    not answer, the split is planned on the others; the host is resumed while the new pipeline
    runs, and whatever its old stage then sends belongs to a pipeline with another key."""
    net, rh = hosts
    frozen: dict = {}

    def freeze(h):
        frozen["pids"] = rh.freeze(h)

    try:
        fault_run(hosts, model, reference, "specpipe-db", freeze, lambda h: rh.thaw(frozen.pop("pids")))
    finally:
        if "pids" in frozen:
            rh.thaw(frozen["pids"])


def test_a_partitioned_host_is_planned_around(hosts, model, reference):
    """A stage's host cut off (its link down: frames vanish, nothing is reset); healed after."""
    net, _ = hosts
    cut: list = []

    def partition(h):
        cut.append(h)
        h.link(False)

    try:
        fault_run(hosts, model, reference, "specpipe", partition)
    finally:
        for h in cut:
            h.link(True)


def test_a_lost_host_is_planned_around(hosts, model, reference):
    """Last: a stage's host lost for good (every process of its Ray node killed)."""
    _, rh = hosts
    fault_run(hosts, model, reference, "pp", rh.kill, standby=True)
