"""The planner: a contiguous split within every node's memory, best by the mode's objective."""

from __future__ import annotations

import time

import pytest

from specpipe.cluster.planner import GiB, ModelBytes, NodeReport, PlanError, plan_split

MB = 2**20


def model(layers: int = 24, layer_mb: int = 40, kv_mb: int = 4) -> ModelBytes:
    return ModelBytes(layer_bytes=(layer_mb * MB,) * layers, embed_bytes=100 * MB, head_bytes=100 * MB,
                      kv_bytes_per_layer=kv_mb * MB, runtime_bytes=200 * MB)


def node(name: str, free_gb: float, layer_ms: float) -> NodeReport:
    return NodeReport(name, name, int(free_gb * GiB), layer_ms)


def counts(plan) -> list[int]:
    return [s.layers for s in plan.stages]


def test_equal_nodes_split_evenly_with_the_head_on_a_lighter_last_stage():
    plan = plan_split([node(f"n{i}", 8, 1.0) for i in range(3)], model(), "throughput")
    assert sum(counts(plan)) == 24 and len(plan.stages) == 3
    # The head costs 2.5 layers (100 MB over 40 MB): the last stage takes fewer layers.
    assert counts(plan)[-1] < counts(plan)[0]
    assert plan.step_ms == pytest.approx(max(s.predicted_ms for s in plan.stages))
    specs = plan.specs()
    assert specs[0].first and specs[-1].last and specs[0].start == 0 and specs[-1].end == 24


def test_speed_bound_a_fast_node_takes_more_layers():
    fast, slow1, slow2 = node("fast", 8, 1.0), node("slow1", 8, 2.0), node("slow2", 8, 2.0)
    plan = plan_split([slow1, fast, slow2], model(), "throughput")
    by_node = {s.node.name: s.layers for s in plan.stages}
    assert by_node["fast"] > by_node["slow1"] and by_node["fast"] > by_node["slow2"]
    # Within one layer's time of the ideal: the fast node has half the work.
    assert plan.step_ms <= (24 + 2.5) / 2 * 1.0 + 2.0
    # pp (latency): everything on the fast node, which holds the whole model.
    pp = plan_split([slow1, fast, slow2], model(), "latency")
    assert [s.node.name for s in pp.stages] == ["fast"] and counts(pp) == [24]


def test_memory_bound_a_small_node_takes_only_what_fits():
    small, big = node("small", 0.6, 1.0), node("big", 8, 3.0)
    plan = plan_split([small, big], model(), "latency")
    for s in plan.stages:
        assert s.bytes <= s.node.free_bytes
    assert {s.node.name for s in plan.stages} == {"small", "big"}  # neither holds it alone faster
    assert sum(counts(plan)) == 24


def test_does_not_fit_names_the_need_and_what_to_do():
    with pytest.raises(PlanError, match=r"does not fit .* 2 nodes .*--max-context"):
        plan_split([node("a", 0.5, 1.0), node("b", 0.5, 1.0)], model())


def test_exact_stages_more_than_nodes_share_a_node():
    plan = plan_split([node("a", 8, 1.0), node("b", 8, 1.0)], model(), "throughput", stages=3)
    assert len(plan.stages) == 3
    names = [s.node.name for s in plan.stages]
    assert sorted(set(names)) == ["a", "b"]


def test_given_layer_counts_are_kept_and_checked():
    plan = plan_split([node("a", 8, 1.0), node("b", 8, 2.0)], model(), "throughput", stage_layers=[20, 4])
    assert counts(plan) == [20, 4] and plan.stages[0].node.name == "a"
    with pytest.raises(PlanError, match="sum to the model's 24"):
        plan_split([node("a", 8, 1.0)], model(), stage_layers=[3, 4])


def test_max_stages_and_a_dead_cluster():
    plan = plan_split([node(f"n{i}", 8, 1.0) for i in range(4)], model(), "throughput", max_stages=2)
    assert len(plan.stages) == 2
    with pytest.raises(PlanError, match="no live node"):
        plan_split([], model())


def test_a_big_cluster_plans_in_seconds():
    t0 = time.perf_counter()
    plan = plan_split([node(f"n{i}", 40, 1.0 + (i % 3)) for i in range(8)], model(layers=80), "throughput")
    assert time.perf_counter() - t0 < 20 and sum(counts(plan)) == 80


# -- the network --------------------------------------------------------------------------------

def links_among(ids: list[str], slow: tuple[str, str], fast_bps: float = 1e9, slow_bps: float = 1.25e6,
                rtt_ms: float = 0.1) -> dict:
    """Every pair (the driver too) fast, both directions of `slow` at 10 Mbit/s."""
    from specpipe.cluster.planner import DRIVER, Link

    out = {}
    for a in [DRIVER, *ids]:
        for b in [DRIVER, *ids]:
            if a != b:
                out[a, b] = Link(rtt_ms, slow_bps if {a, b} == set(slow) else fast_bps)
    return out


def wide_model(layers: int = 24) -> ModelBytes:
    # Hidden states of 64 KiB a row: what crosses a link per token matters against 1 ms layers.
    return ModelBytes(layer_bytes=(40 * MB,) * layers, embed_bytes=100 * MB, head_bytes=100 * MB,
                      kv_bytes_per_layer=4 * MB, runtime_bytes=200 * MB, row_bytes=64 << 10)


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_the_order_keeps_the_slow_link_out_of_the_pipeline(objective):
    """Three equal nodes that each hold a third of the model, the a<->b pair at 10 Mbit/s: every
    order of three stages that puts a next to b crosses it every step (50 ms for a 64 KiB row);
    the planner puts c between them, and prints the links it used."""
    from specpipe.cluster.planner import Plan

    nodes = [node(n, 1.2, 1.0) for n in "abc"]  # 1.2 GB: a node holds at most a third of the layers
    links = links_among(["a", "b", "c"], ("a", "b"))
    plan = plan_split(nodes, wide_model(), objective, stages=3, links=links)
    order = [s.node.name for s in plan.stages]
    assert order[1] == "c", order
    assert all(s.hop_in_ms < 5 for s in plan.stages) and plan.hop_out_ms < 5
    crossing = Plan(tuple(type(s)(nodes["abc".index(n)], s.start, s.end, s.bytes, s.predicted_ms,
                                  50.0 if i else s.hop_in_ms)
                          for i, (s, n) in enumerate(zip(plan.stages, "abc"))), objective, 0.0, plan.hop_out_ms)
    assert crossing.step_ms > plan.step_ms
    text = "\n".join(plan.describe())
    assert "link c -> " in text and "Mbit/s" in text and "back to the driver" in text


def test_a_slow_link_to_the_driver_costs_tokens_only():
    """The driver <-> a link slow: only a first or last stage talks to the driver, and only in
    tokens (a few hundred bytes a step: 0.2 ms at 10 Mbit/s), so any order is cheap; the middle
    avoids even that."""
    from specpipe.cluster.planner import DRIVER

    nodes = [node(n, 1.2, 1.0) for n in "abc"]
    links = links_among(["a", "b", "c"], (DRIVER, "a"))
    plan = plan_split(nodes, wide_model(), "latency", stages=3, links=links)
    assert [s.node.name for s in plan.stages][1] == "a"
    hops = sum(s.hop_in_ms for s in plan.stages) + plan.hop_out_ms
    assert hops < 1.0, hops  # four fast hops (0.05 ms each and 64 KiB at 1 GB/s), nothing slow


def test_a_slow_link_makes_fewer_stages_win_in_pp():
    """Where one node holds the model, pp (latency) needs no hop at all: with a slow cluster
    network it takes one stage; stages=2 forced still keeps off the slow pair."""
    nodes = [node(n, 8, 1.0) for n in "ab"]
    links = links_among(["a", "b"], ("a", "b"))
    assert len(plan_split(nodes, wide_model(), "latency", links=links).stages) == 1
    two = plan_split(nodes, wide_model(), "latency", stages=2, links=links)
    assert two.stages[1].hop_in_ms > 40  # the only order crosses it: predicted, not hidden


def test_without_links_the_uniform_hop_is_kept():
    plan = plan_split([node(n, 8, 1.0) for n in "ab"], model(), "latency", stages=2, link_ms=3.0)
    assert plan.step_ms == pytest.approx(sum(s.predicted_ms for s in plan.stages) + 3.0)
    assert "link " not in "\n".join(plan.describe())


def test_an_order_by_hand_is_kept_and_costed():
    """order=: the benchmark's orders by hand; the split is still planned, the hops still costed."""
    nodes = [node(n, 1.2, 1.0) for n in "abc"]
    links = links_among(["a", "b", "c"], ("a", "b"))
    plan = plan_split(nodes, wide_model(), "latency", stages=3, links=links, order=["a", "b", "c"])
    assert [s.node.name for s in plan.stages] == ["a", "b", "c"]
    assert plan.stages[1].hop_in_ms > 40  # 64 KiB over 10 Mbit/s: predicted, not hidden
    best = plan_split(nodes, wide_model(), "latency", stages=3, links=links)
    assert best.step_ms < plan.step_ms
