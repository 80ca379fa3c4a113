"""Faster recovery of a `--cluster ray` pipeline, without a cluster: a restart asks every node
agent at once with one short deadline and plans around the silent ones without forgetting them,
a node started again on a lost node's host takes over its calibration and links instead of being
measured in the restart, standby stage actors are taken before new ones are spawned, and a
pipeline that served a while restarts with the shortest back-off. (On real hosts, with faults:
tests/cluster/test_hosts.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from specpipe.cluster.planner import Link, NodeReport  # noqa: E402


class Ref:
    """An object ref to a probe's answer: a probe dict, or "timeout" (never ready) / "dead"."""

    def __init__(self, answer):
        self.answer = answer


class FakeAgent:
    """A node agent whose probe answers `answer`."""

    def __init__(self, answer):
        self.answer = answer
        self.probe = SimpleNamespace(remote=lambda device: Ref(self.answer))


def probe(ip: str, cores: int = 2) -> dict:
    return {"node_id": ip, "ip": ip, "host": f"host-{ip}", "free_bytes": 8 << 30, "cores": cores}


@pytest.fixture
def backend(monkeypatch):
    """A RayBackend after its first start over nodes a, b, c (calibrated, links measured), its Ray
    calls replaced: ray.get answers a fake agent's probe or raises as told."""
    from specpipe.cluster import placement
    from specpipe.cluster import ray_backend as rb

    b = object.__new__(rb.RayBackend)
    b.config = SimpleNamespace(device="cpu")
    b.progress, b.said = None, []
    b.progress = b.said.append
    b.state, b.restarts = "running", 1
    b.silent, b._gone, b._standby = set(), {}, {}
    b._lock, b._timer = threading.Lock(), None
    b.agents = {n: FakeAgent(probe(n)) for n in "abc"}
    b.nodes = {n: probe(n) for n in "abc"}
    b.reports = {n: NodeReport(n, n, 8 << 30, 1.0 + i, 2) for i, n in enumerate("abc")}
    b.links = {(x, y): Link(0.1, 1e9) for x in "abc" for y in "abc" if x != y}
    b.live = set("abc")
    b.calibrated = []
    b.plan = SimpleNamespace(stages=[1, 2])  # a two-stage pipeline
    b.clock = [0.0]  # the backend's monotonic clock, advanced by ray.wait's timeouts

    def get(ref, timeout=None):
        if ref.answer == "timeout":
            raise ray.exceptions.GetTimeoutError()
        if ref.answer == "dead":
            raise ray.exceptions.RayActorError()
        return ref.answer

    def wait(refs, num_returns=1, timeout=None):
        b.clock[0] += timeout or 0.0
        return [r for r in refs if r.answer != "timeout"], [r for r in refs if r.answer == "timeout"]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(rb, "time", SimpleNamespace(monotonic=lambda: b.clock[0], perf_counter=lambda: b.clock[0]))
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)
    monkeypatch.setattr(placement, "live_nodes", lambda: [{"NodeID": n} for n in sorted(b.live)])
    monkeypatch.setattr(placement, "on_node", lambda nid: {})
    monkeypatch.setattr(rb.RayBackend, "_calibrate", lambda self, new: self.calibrated.extend(new))
    monkeypatch.setattr(rb.RayBackend, "_measure_links", lambda self, new: None)
    return b


def test_a_silent_node_sits_the_restart_out_and_comes_back_without_measuring(backend):
    """A frozen host's agent misses the restart's deadline: planned around (not available), its
    agent and figures kept; once it answers again it is available, nothing measured again."""
    backend.agents["b"].answer = "timeout"
    backend._refresh_nodes()
    assert backend.silent == {"b"} and "b" in backend.agents and "b" in backend.reports
    assert set(backend._available()) == {"a", "c"} and backend.calibrated == []
    backend.agents["b"].answer = probe("b")
    backend._refresh_nodes()
    assert backend.silent == set() and set(backend._available()) == {"a", "b", "c"}
    assert backend.calibrated == []


@pytest.mark.parametrize("stages", [2, 3])
def test_a_restart_waits_for_a_silent_agent_only_while_it_needs_the_node(backend, stages):
    """Three nodes, one frozen: a two-stage pipeline goes on once the other two have answered
    and the grace has passed; a three-stage one waits the whole deadline for the third."""
    from specpipe.cluster.ray_backend import RESTART_GRACE_S, RESTART_PING_S

    backend.plan = SimpleNamespace(stages=list(range(stages)))
    backend.agents["c"].answer = "timeout"
    backend._refresh_nodes()
    assert backend.silent == {"c"} and "c" in backend.agents
    if stages == 2:
        assert RESTART_GRACE_S <= backend.clock[0] < RESTART_GRACE_S + 0.1 < RESTART_PING_S
    else:
        assert RESTART_PING_S <= backend.clock[0] < RESTART_PING_S + 0.1


def test_a_node_started_again_on_a_lost_hosts_address_takes_over_its_figures(backend, monkeypatch):
    """A host lost (its agent dead) and its Ray node started again (a new node id, the same
    address, host name and cores): the restart takes over the old node's calibration and links
    instead of timing a layer and measuring links while every request waits."""
    from specpipe.cluster import ray_backend as rb

    backend.agents["c"].answer = "dead"
    backend._refresh_nodes()
    assert "c" not in backend.agents and "c" not in backend.reports and set(backend._available()) == {"a", "b"}
    # Its node is back, as c2; Ray starts it an agent.
    backend.live = {"a", "b", "c2"}
    monkeypatch.setattr(ray, "remote", lambda **kw: (lambda cls: SimpleNamespace(
        options=lambda **o: SimpleNamespace(remote=lambda: FakeAgent(dict(probe("c"), node_id="c2"))))))
    monkeypatch.setattr(rb, "NodeReport", NodeReport)
    backend._refresh_nodes()
    assert backend.calibrated == []  # not timed again
    assert backend.reports["c2"].layer_ms == 3.0 and backend.links["a", "c2"] == backend.links["a", "c"]
    assert backend.links["c2", "b"] == backend.links["c", "b"]
    assert any("taken over, not measured again" in m for m in backend.said)
    # A node on a host never seen is calibrated as before.
    backend.live = {"a", "b", "c2", "d"}
    monkeypatch.setattr(ray, "remote", lambda **kw: (lambda cls: SimpleNamespace(
        options=lambda **o: SimpleNamespace(remote=lambda: FakeAgent(probe("d"))))))
    backend._refresh_nodes()
    assert backend.calibrated == ["d"]


def test_a_silent_node_whose_host_has_a_new_node_is_replaced(backend, monkeypatch):
    """A lost host's old node is still listed live (Ray has not noticed yet) and silent when its
    new node appears: the new one takes its place and figures."""
    backend.agents["c"].answer = "timeout"
    backend._refresh_nodes()
    assert backend.silent == {"c"}
    backend.live = {"a", "b", "c", "c2"}
    monkeypatch.setattr(ray, "remote", lambda **kw: (lambda cls: SimpleNamespace(
        options=lambda **o: SimpleNamespace(remote=lambda: FakeAgent(dict(probe("c"), node_id="c2"))))))
    backend._refresh_nodes()
    assert "c" not in backend.agents and backend.silent == set() and backend.calibrated == []
    assert set(backend._available()) == {"a", "b", "c2"}


def test_a_restart_takes_the_nodes_standby_actor(backend, monkeypatch):
    """The standby of a node is handed out once; a standby that died is not."""
    waited = {}
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: (_ for _ in ()).throw(RuntimeError("died")))
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=0: (refs, []) if waited.get(refs[0]) else ([], refs))
    backend._standby = {"a": ("actor-a", "warming"), "b": ("actor-b", "dead")}
    assert backend._take_standby("a") == "actor-a" and backend._take_standby("a") is None
    waited["dead"] = True
    assert backend._take_standby("b") is None and backend._standby == {}


def test_standbys_go_only_to_nodes_with_memory_to_spare(backend, monkeypatch):
    """A standby takes a worker's memory: nodes with less than STANDBY_MIN_FREE available get
    none (a restart there starts a new worker, as before); a silent node gets none either."""
    from specpipe.cluster import ray_backend as rb

    made = []
    monkeypatch.setattr(rb, "_stage_actor_cls", lambda: SimpleNamespace(options=lambda **o: SimpleNamespace(
        remote=lambda: made.append(1) or SimpleNamespace(warm=SimpleNamespace(remote=lambda: f"warm{len(made)}")))))
    backend.agents["a"].answer = dict(probe("a"), free_bytes=rb.STANDBY_MIN_FREE - 1)
    backend.silent = {"c"}
    backend._warm_standbys()
    assert set(backend._standby) == {"b"} and len(made) == 1
    assert any(m.startswith("no standby stage actor on node ") and "under 3 GB" in m for m in backend.said)
    backend._warm_standbys()  # b has one already
    assert len(made) == 1
    backend.state = "closed"
    backend.silent = set()
    backend._warm_standbys()  # closed: nothing new
    assert len(made) == 1
