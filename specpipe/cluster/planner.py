"""Which machine holds which layers: a contiguous split chosen from each node's memory and speed.

    nodes (free memory, one layer's measured step)  +  the model's bytes per layer
        ->  for each order of the nodes tried, a dynamic programme over (node, layers placed,
            stages used)  ->  the split whose objective is best, within every node's memory

A stage on node n holding layers [a, b) costs (b - a + head) x layer_ms(n) per step, where `head`
is the LM head's cost in layers on the last stage (a CPU's decode reads weights from memory, so
the head costs its bytes over a layer's); it holds the weights of its layers, the embedding
(first stage), the head (last stage), their KV for the whole pool, and a fixed runtime.

Two objectives, by how the mode uses the pipeline:
  latency     pp and tree: a token crosses every stage in turn, so the step is the *sum* of the
              stages (plus a link per hop); fewer, faster machines win, and the plan may use
              fewer stages than nodes (all on the fastest node that holds the model).
  throughput  pp-cb, specpipe, specpipe-db: every stage computes at once, so the step is the
              *slowest* stage; layers spread until the stages are even in time, not in count.
Ties go to the other objective. Several stages on one node (more stages asked than nodes) share
its memory and cores: each such slot gets its share of both.

The network: `links` maps (from, to) node ids ("driver" for the driver) to a measured Link
(round trip, bytes per second; cluster/links.py). A hop costs half the round trip plus what
crosses it over the rate: the new tokens from the driver into stage 1, a hidden state per row
between stages, the target's tokens from the last stage back. A stage's step is then its input
hop plus its compute (it cannot start before its rows arrive), and the return hop is the
driver's: so the latency objective adds every hop of the order, and the throughput objective
takes the slowest of these. The order of the nodes therefore matters, not only the split: a slow
link belongs where little crosses it (next to the driver) or nowhere.

Pure: no Ray, no torch; `cluster/ray_backend.py` measures the reports and runs the plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from specpipe.config import ConfigError, StageSpec
from specpipe.loader.partition import partition_layers

LATENCY_MODES = ("pp", "tree")
GiB = 2**30


DRIVER = "driver"  # the driver's id in a link matrix
FRAME_BYTES = 256  # what a step's frame carries besides the rows: header, MAC, node ids, positions
TOKEN_BYTES = 16  # a row's token to stage 1, or its target token back to the driver


@dataclass(frozen=True)
class Link:
    """One direction between two endpoints, as measured."""

    rtt_ms: float
    bytes_per_s: float

    def ms(self, nbytes: int) -> float:
        return self.rtt_ms / 2 + 1e3 * nbytes / max(1.0, self.bytes_per_s)


class PlanError(ConfigError):
    """The model does not fit the nodes (or the asked-for split does not); the message says why."""


@dataclass(frozen=True)
class NodeReport:
    """What a node offers: memory the stages may take and one layer's measured step time."""

    node_id: str
    name: str  # how the plan prints it (host address, or Ray's node name)
    free_bytes: int
    layer_ms: float
    threads: int = 1


@dataclass(frozen=True)
class ModelBytes:
    """What the planner knows of the model."""

    layer_bytes: tuple[int, ...]  # weights of each decoder layer
    embed_bytes: int  # the token embedding (first stage)
    head_bytes: int  # final norm + LM head (last stage; the embedding again when tied)
    kv_bytes_per_layer: int  # one layer's share of the KV pool every stage holds
    runtime_bytes: int = GiB // 2  # a stage process: interpreter, torch, buffers
    row_bytes: int = 0  # one row's hidden state between stages, as sent

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def head_layers(self) -> float:
        """The LM head's step in layers: its bytes over an average layer's."""
        mean = sum(self.layer_bytes) / max(1, self.num_layers)
        return self.head_bytes / mean if mean else 0.0

    def stage_bytes(self, start: int, end: int) -> int:
        return (sum(self.layer_bytes[start:end]) + (end - start) * self.kv_bytes_per_layer + self.runtime_bytes
                + (self.embed_bytes if start == 0 else 0) + (self.head_bytes if end == self.num_layers else 0))


@dataclass(frozen=True)
class StagePlan:
    node: NodeReport
    start: int
    end: int
    bytes: int
    predicted_ms: float  # its compute
    hop_in_ms: float = 0.0  # its rows reaching it from the previous stage (the driver for stage 1)

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    objective: str
    link_ms: float = 0.0
    hop_out_ms: float = 0.0  # the last stage's tokens reaching the driver
    links: Optional[Mapping[tuple[str, str], Link]] = None

    def specs(self) -> list[StageSpec]:
        """The stages as every other split is made (loader/partition.py), from the planned counts."""
        return partition_layers(self.stages[-1].end, len(self.stages), [s.layers for s in self.stages])

    @property
    def step_ms(self) -> float:
        """The predicted step: the slowest stage (throughput) or the sum with the hops (latency)."""
        return _value(self.objective, [s.predicted_ms + s.hop_in_ms for s in self.stages], self.hop_out_ms)[0]

    def describe(self) -> list[str]:
        lines = [f"plan ({self.objective}: {len(self.stages)} stage{'s' if len(self.stages) > 1 else ''}, "
                 f"predicted {self.step_ms:.1f} ms per step):"]
        for i, s in enumerate(self.stages):
            hop = f", its input {s.hop_in_ms:.2f} ms over the link" if self.links else ""
            lines.append(f"  stage {i + 1}: node {s.node.name}, layers {s.start}-{s.end - 1} ({s.layers}), "
                         f"{s.bytes / GiB:.2f} GB of {s.node.free_bytes / GiB:.2f} GB free, "
                         f"{s.predicted_ms:.1f} ms per step{hop}")
        if self.links:
            lines.append(f"  back to the driver: {self.hop_out_ms:.2f} ms over the link")
            names = {s.node.node_id: s.node.name for s in self.stages}
            path = [DRIVER] + [s.node.node_id for s in self.stages] + [DRIVER]
            for a, b in zip(path, path[1:]):
                if a != b and (a, b) in self.links:
                    ln = self.links[a, b]
                    lines.append(f"  link {names.get(a, a)} -> {names.get(b, b)}: {ln.rtt_ms:.2f} ms round trip, "
                                 f"{8 * ln.bytes_per_s / 1e6:.1f} Mbit/s")
        return lines


def objective_for(mode: str) -> str:
    return "latency" if mode in LATENCY_MODES else "throughput"


def plan_split(nodes: Sequence[NodeReport], model: ModelBytes, objective: str = "throughput",
               max_stages: Optional[int] = None, stages: Optional[int] = None,
               stage_layers: Optional[Sequence[int]] = None, link_ms: float = 0.0,
               links: Optional[Mapping[tuple[str, str], Link]] = None, rows: int = 1,
               order: Optional[Sequence[str]] = None) -> Plan:
    """The best contiguous split of `model` over `nodes`, in the best order of the nodes.

    max_stages: use at most this many stages (default: one per node). stages: exactly this many
    (a restarted pipeline keeps its stage count); more than the nodes puts several on a node.
    stage_layers: the layer counts are given (--stage-layers); only the nodes are chosen.
    links: the measured link matrix (see the module docstring), `rows` the rows a step sends;
    without it every hop between stages costs `link_ms` and the driver's hops nothing.
    order: node ids in the order their stages must run (an order chosen by hand, e.g. by a
    benchmark comparing orders); the split is still planned."""
    if objective not in ("latency", "throughput"):
        raise ValueError(f"objective must be latency or throughput, got {objective!r}")
    if not nodes:
        raise PlanError("no node to place the stages on: the Ray cluster has no live node")
    L = model.num_layers
    if stage_layers is not None:
        stages = len(stage_layers)
        if sum(stage_layers) != L or min(stage_layers) < 1:
            raise PlanError(f"--stage-layers {','.join(map(str, stage_layers))} must be positive and sum to the "
                            f"model's {L} layers")
    if stages is not None and not 1 <= stages <= L:
        raise PlanError(f"--stages {stages} must be between 1 and the model's {L} layers")
    limit = stages or min(max_stages or len(nodes), len(nodes), L)
    slots = _slots(nodes, stages or limit)
    best: Optional[Plan] = None
    hop = _hop_cost(model, link_ms, links, rows)
    if order is not None:
        by_id = {n.node_id: n for n in slots}
        orders = [[by_id[nid] for nid in order]]
    else:
        orders = _orders(slots, links)
    for nodes_in_order in orders:
        plan = _best_split(nodes_in_order, model, objective, limit, exact=stages is not None, counts=stage_layers,
                           hop=hop, link_ms=link_ms, links=links)
        if plan is not None and (best is None or _key(plan) < _key(best)):
            best = plan
    if best is None:
        raise PlanError(_does_not_fit(nodes, model, stages or limit))
    return best


def _value(objective: str, stage_ms: Sequence[float], out_ms: float) -> tuple[float, float]:
    """(the objective, the other one) of stages costing `stage_ms` each (input hop + compute),
    with the return hop to the driver `out_ms`."""
    total, slowest = sum(stage_ms) + out_ms, max([*stage_ms, out_ms])
    return (slowest, total) if objective == "throughput" else (total, slowest)


def _key(plan: Plan) -> tuple[float, float, int]:
    primary, secondary = _value(plan.objective, [s.predicted_ms + s.hop_in_ms for s in plan.stages], plan.hop_out_ms)
    return (round(primary, 9), round(secondary, 9), len(plan.stages))


def _hop_cost(model: ModelBytes, link_ms: float, links: Optional[Mapping[tuple[str, str], Link]], rows: int):
    """hop(from id, to id) -> ms of a step's frame between them (DRIVER for the driver)."""
    def hop(a: str, b: str) -> float:
        if links is None:  # the uniform figure: between stages only
            return 0.0 if DRIVER in (a, b) or a == b else link_ms
        if a == b:
            return 0.0  # two stages on one node: no network between them
        nbytes = FRAME_BYTES + rows * (TOKEN_BYTES if DRIVER in (a, b) else model.row_bytes)
        link = links.get((a, b)) or links.get((b, a))
        # link_ms (--link-delay-ms) is what the transport adds to every message on top of the wire
        return (link.ms(nbytes) if link is not None else 0.0) + link_ms
    return hop


def _slots(nodes: Sequence[NodeReport], wanted: int) -> list[NodeReport]:
    """One slot per node, or, where more stages are wanted than there are nodes, several slots on
    the fastest nodes first, each with its share of the node's memory and cores."""
    if wanted <= len(nodes):
        return list(nodes)
    by_speed = sorted(nodes, key=lambda n: n.layer_ms)
    share = {n.node_id: 0 for n in nodes}
    for i in range(wanted):
        share[by_speed[i % len(by_speed)].node_id] += 1
    out = []
    for n in nodes:
        k = share[n.node_id]
        out += [replace(n, free_bytes=n.free_bytes // k, layer_ms=n.layer_ms * k, threads=max(1, n.threads // k))] * k
    return out


def _orders(slots: list[NodeReport], links: Optional[Mapping[tuple[str, str], Link]] = None) -> list[list[NodeReport]]:
    """The node orders tried: every order for a few nodes (four: 24 orders), else as given, by
    speed both ways, and, with links, the nearest-neighbour path from the driver (each next node
    the one with the fastest link from the last)."""
    if len(slots) <= 4:
        return [list(p) for p in itertools.permutations(slots)]
    by_speed = sorted(slots, key=lambda n: n.layer_ms)
    orders = [list(slots), by_speed, by_speed[::-1]]
    if links:
        left, path, at = list(slots), [], DRIVER
        while left:
            nxt = max(left, key=lambda n: getattr(links.get((at, n.node_id)), "bytes_per_s", 0.0))
            path.append(nxt)
            left.remove(nxt)
            at = nxt.node_id
        orders.append(path)
    return orders


def _best_split(order: list[NodeReport], model: ModelBytes, objective: str, limit: int, exact: bool,
                counts: Optional[Sequence[int]], hop, link_ms: float,
                links: Optional[Mapping[tuple[str, str], Link]]) -> Optional[Plan]:
    """Dynamic programme over (slots considered, stages used, layers placed, the last stage's
    node): each slot either takes the next contiguous run of layers or is left out (never when
    `exact` and counts say every slot is needed). The last node is in the state because the next
    stage's input hop depends on it. best[k][(l, last)]: the best (objective tuple, stages)
    placing layers [0, l) on k stages."""
    L, head = model.num_layers, model.head_layers
    prefix = list(itertools.accumulate(model.layer_bytes, initial=0))

    def cost(node: NodeReport, a: int, b: int) -> Optional[tuple[float, int]]:
        nbytes = (prefix[b] - prefix[a] + (b - a) * model.kv_bytes_per_layer + model.runtime_bytes
                  + (model.embed_bytes if a == 0 else 0) + (model.head_bytes if b == L else 0))
        if nbytes > node.free_bytes:
            return None
        return (b - a + (head if b == L else 0.0)) * node.layer_ms, nbytes

    def combine(acc: tuple, ms: float) -> tuple:
        primary, secondary = acc
        if objective == "throughput":
            return (max(primary, ms), secondary + ms)
        return (primary + ms, max(secondary, ms))

    best: list[dict[tuple[int, str], tuple]] = [dict() for _ in range(limit + 1)]
    best[0][(0, DRIVER)] = ((0.0, 0.0), [])
    for node in order:
        nxt = [dict(level) for level in best]  # leaving this slot out keeps everything
        for k in range(limit):
            for (a, last), (acc, stages) in best[k].items():
                hop_in = hop(last, node.node_id)
                ends = [a + counts[k]] if counts is not None else range(a + 1, L + 1)
                for b in ends:
                    c = cost(node, a, b)
                    if c is None:
                        break  # more layers only need more memory
                    value = combine(acc, hop_in + c[0])
                    at = (b, node.node_id)
                    if at not in nxt[k + 1] or value < nxt[k + 1][at][0]:
                        nxt[k + 1][at] = (value, stages + [StagePlan(node, a, b, c[1], c[0], hop_in)])
        best = nxt
    plans = [Plan(tuple(stages), objective, link_ms, hop(last, DRIVER), links)
             for k in range(1, limit + 1) if not exact or k == limit
             for (l, last), (_, stages) in best[k].items() if l == L]
    return min(plans, key=_key) if plans else None


def _does_not_fit(nodes: Sequence[NodeReport], model: ModelBytes, stages: int) -> str:
    whole = model.stage_bytes(0, model.num_layers)
    free = sum(n.free_bytes for n in nodes)
    biggest = max(model.stage_bytes(i, i + 1) for i in range(model.num_layers))
    return (f"the model does not fit the cluster's {len(nodes)} node{'s' if len(nodes) > 1 else ''} in "
            f"{stages} stage{'s' if stages > 1 else ''}: it needs {whole / GiB:.2f} GB with its KV pool "
            f"(the largest single layer with embedding or head {biggest / GiB:.2f} GB), the nodes have "
            f"{free / GiB:.2f} GB free in all ({', '.join(f'{n.name}: {n.free_bytes / GiB:.2f}' for n in nodes)}); "
            f"add a node, or lower --max-context / --max-num-seqs (or --kv-memory) to shrink the KV pool")
