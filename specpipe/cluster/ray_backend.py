"""The driver's side of `--cluster ray`: the machines of a Ray cluster as one pipeline.

    join the cluster  ->  an agent per node: free memory, cores, one layer's measured step,
            the round trip and rate of every link between the nodes and the driver (cluster/links.py)
        ->  plan the split and the order (cluster/planner.py), print it  ->  each stage's weights on
            its node (the node's own copy of the file, its cache, or streamed from here, every node
            at once and resumed where a transfer was cut off: cluster/streaming.py, weights.py)
        ->  a stage actor per stage, a fresh key and rendezvous per pipeline  ->  RemotePipeline

The driver stays in the calling process; the per-step data go over our own framed TCP links
(distributed/sockets.py), authenticated by the pipeline's key. `start` is also what recovery
calls (engine/restart.py): nodes that no longer answer are dropped, the split is planned again
on those left (same number of stages) where a planned node is gone, and the new stages load
from their nodes' caches; the engine core recomputes every request in flight from its tokens.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from specpipe.cluster.planner import DRIVER, Link, ModelBytes, NodeReport, Plan, PlanError, objective_for, plan_split
from specpipe.config import SPECULATIVE_MODES, ConfigError, EngineConfig, StageSpec
from specpipe.distributed.remote_pipeline import PipelineError, RemotePipeline
from specpipe.loader.checkpoint import Checkpoint

Progress = Optional[Callable[[str], None]]
PING_S = 5.0  # a node agent that does not answer within this is taken for lost
RESTART_PING_S = 2.0  # at a restart, one deadline for every agent: a silent node sits this pipeline out ...
RESTART_GRACE_S = 0.5  # ... or this, once as many nodes as stages have answered
STANDBY_AFTER_S = 5.0  # standby stage actors are started this long after a pipeline is up (not during its first steps)
STANDBY_MIN_FREE = 3 << 30  # ... on nodes with at least this much memory available (a standby takes ~0.4 GB)
AGENT_START_S = 60.0  # ... or, for an agent just started, within this
LOAD_TIMEOUT_S = 600.0
CHUNK_ENV = "SPECPIPE_WEIGHT_CHUNK"  # the streamed chunk's size on the driver, e.g. 1MiB (default 8 MiB)


def stream_chunk_bytes(option: Optional[str] = None) -> int:
    """The chunk size weights are streamed in: --weight-chunk (`option`), else
    $SPECPIPE_WEIGHT_CHUNK, else weights.CHUNK_BYTES. Smaller chunks resume closer to where a
    transfer stopped and hold less memory in flight; larger ones cost fewer calls."""
    from specpipe.cluster.weights import CHUNK_BYTES, parse_weight_chunk

    if option is not None:
        return parse_weight_chunk(option)
    text = os.environ.get(CHUNK_ENV, "").strip()
    return parse_weight_chunk(text, f"${CHUNK_ENV}") if text else CHUNK_BYTES


class RayBackend:
    def __init__(self, config: EngineConfig, ckpt: Checkpoint, model_path: Path, blocks: Callable[[int], int],
                 weight_bytes: int, progress: Progress = None) -> None:
        """`blocks(S)`: the KV blocks per stage of S stages (the engine's stage plan sizes them:
        engine/stage_plan.py cluster_blocks); `weight_bytes`: what the stages hold of the whole
        model's weights once loaded."""
        import ray

        from specpipe.cluster.placement import connect, driver_node_id

        connect(config.ray_address)
        self.config, self.ckpt, self.model_path, self.progress = config, ckpt, Path(model_path), progress
        self.driver_node = driver_node_id()
        self.driver_ip = ray.util.get_node_ip_address()
        self.agents: dict[str, object] = {}
        self.nodes: dict[str, dict] = {}  # node id -> its probe
        self.reports: dict[str, NodeReport] = {}
        self.links: dict[tuple[str, str], Link] = {}  # (from, to) node ids, DRIVER for this process
        self._digests: dict[StageSpec, tuple] = {}
        self.chunk_bytes = stream_chunk_bytes(config.weight_chunk)
        self.restarts = 0
        self.state = "starting"
        self.silent: set[str] = set()  # nodes whose agent missed the last restart's ping: planned around, kept
        self._gone: dict[tuple, tuple[float, str]] = {}  # (ip, host, cores) of a node gone -> (its ms, its id)
        # A standby stage actor per node, its imports done (StageActor.warm): a restart takes it
        # instead of waiting for a new Ray worker process to start and import torch and SpecPipe.
        self._standby: dict[str, tuple] = {}  # node id -> (actor, its warm() ref)
        self._lock = threading.Lock()  # the standbys, between the engine's thread and the timer's
        self._timer: Optional[threading.Timer] = None
        self._refresh_nodes()
        S_max = config.stages or len(self.reports)
        L = ckpt.config.num_layers
        # Before the split is known, each node as if it held an even share of the layers.
        self.num_blocks = min([blocks(S_max)] + [self._memory_blocks(r.free_bytes, -(-L // S_max), 0)
                                                  for r in self.reports.values()])
        self.model = model_bytes(ckpt, config, self.num_blocks, weight_bytes)
        counts = config.stage_layers if isinstance(config.stage_layers, list) else None
        self._counts = counts  # --stage-layers: a re-plan after a node is lost keeps them
        self.plan = self._plan(max_stages=config.stages or None, counts=counts)
        S = len(self.plan.stages)
        self.num_blocks = min([self.num_blocks, blocks(S)] + [
            self._memory_blocks(s.node.free_bytes, s.layers, s.bytes - s.layers * self.model.kv_bytes_per_layer)
            for s in self.plan.stages])
        if config.stages and S < config.stages:
            why = (f"the cluster has {len(self.reports)} node{'s' if len(self.reports) > 1 else ''} with CPUs, "
                   "and the plan puts at most one stage on a node" if len(self.reports) < config.stages else
                   f"fewer stages are predicted faster for mode {config.mode} ({objective_for(config.mode)})")
            self._say(f"planned {S} stage{'s' if S > 1 else ''}, not the {config.stages} --stages allows: {why}; "
                      f"--stage-layers with {config.stages} counts places exactly that many")
        self.config = dataclasses.replace(config, stages=len(self.plan.stages),
                                          stage_layers=[s.layers for s in self.plan.stages])

    def _memory_blocks(self, free_bytes: int, layers: int, held_bytes: int) -> int:
        """KV blocks a stage of `layers` layers may take on a node with `free_bytes` free, holding
        `held_bytes` of weights and runtime: without --kv-memory, --kv-memory-fraction of what is
        left, as local stages get (engine/kv_pool.py); the pool is also capped at what
        --max-num-seqs full contexts use (the `blocks` the engine passes), but for a small model
        that cap alone reserved gigabytes (5.8 GB of KV for a 135M model)."""
        c, cfg = self.config, self.ckpt.config
        if c.kv_memory is not None:
            return 1 << 62  # --kv-memory: the engine's cluster_blocks sized it already
        per_block = layers * c.block_size * cfg.kv_values_per_token * _dtype_bytes(c)
        return max(1, int(max(0, free_bytes - held_bytes) * c.kv_memory_fraction) // max(1, per_block))

    # -- nodes ---------------------------------------------------------------------------------
    def _say(self, msg: str) -> None:
        if self.progress:
            self.progress(msg)

    def _refresh_nodes(self) -> None:
        """Agents on every live node; nodes whose agent does not answer are dropped (at a restart,
        one that is merely silent sits this pipeline out: `silent`); new nodes are probed and
        calibrated, unless a node on the same host with the same cores, now gone, was (a node
        started again after its host was lost): its figures and links are taken over."""
        import ray

        from specpipe.cluster.node_agent import NodeAgent
        from specpipe.cluster.placement import live_nodes, on_node

        restart = self.state != "starting"
        # Concurrency: a window of chunk writes for each stage streamed to the node, plus the link probes.
        agent_cls = ray.remote(num_cpus=0, max_concurrency=8)(NodeAgent)
        live = {n["NodeID"] for n in live_nodes()}
        for nid in [nid for nid in self.agents if nid not in live]:  # Ray has declared its node dead
            self._forget(nid)
        started = set()
        for nid in sorted(live):
            if nid not in self.agents:
                self.agents[nid] = agent_cls.options(**on_node(nid)).remote()
                started.add(nid)
        probes = {nid: a.probe.remote(self.config.device) for nid, a in self.agents.items()}
        if restart:
            self._ping_at_restart(probes)
        t0 = time.monotonic()
        for nid, ref in probes.items() if not restart else ():
            # A new agent's first answer waits for a worker process to start on its node (Python,
            # Ray, our imports: over 5 s on a busy machine, which dropped healthy nodes at the
            # first start); an agent that is running answers at once or its node is taken for lost.
            wait = AGENT_START_S if nid in started else PING_S
            try:
                self.nodes[nid] = ray.get(ref, timeout=max(0.1, wait - (time.monotonic() - t0)))
            except Exception:  # noqa: BLE001 (dead, or unreachable: a lost node)
                self._forget(nid)
        if not [nid for nid in self.agents if nid not in self.silent]:
            raise PlanError("the Ray cluster has no live node to run a stage on")
        new = [nid for nid in self.agents if nid not in self.reports]
        for nid in list(new):
            key = (*self._host(nid), self.nodes[nid]["cores"])
            for old in [o for o in self.silent if (*self._host(o), self.nodes[o]["cores"]) == key]:
                self._forget(old)  # its host has a new node: the silent one is gone
            if key in self._gone:
                ms, old = self._gone.pop(key)
                probe = self.nodes[nid]
                self.reports[nid] = NodeReport(nid, self._name(nid), probe["free_bytes"] // self._hosts_sharing(nid),
                                               ms, probe["cores"])
                for (a, b), link in list(self.links.items()):
                    if old in (a, b):
                        self.links[nid if a == old else a, nid if b == old else b] = link
                new.remove(nid)
                self._say(f"node {self._name(nid)}: started again on the host of {old[:6]}, {probe['cores']} cores: "
                          f"its calibration ({ms:.2f} ms a layer) and links taken over, not measured again")
        if new:
            self._calibrate(new)
            self._measure_links(new)

    def _ping_at_restart(self, probes: dict) -> None:
        """Every agent asked at once, one short deadline for all (RESTART_PING_S): a known node
        that misses it (frozen, cut off, or just slow) sits this pipeline out but is asked again
        at the next start, its figures kept; a new agent not up yet is left out (started again
        at the next start); one that fails is a lost node. Once RESTART_GRACE_S has passed and
        as many nodes have answered as the pipeline has stages, nobody waits for the rest: a
        frozen host would otherwise hold every restart for the whole deadline."""
        import ray

        pending = {ref: nid for nid, ref in probes.items()}
        t0, answered = time.monotonic(), 0
        need = len(self.plan.stages) if getattr(self, "plan", None) is not None else len(probes)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.05)
            for ref in ready:
                nid = pending.pop(ref)
                try:
                    self.nodes[nid] = ray.get(ref, timeout=1.0)
                    self.silent.discard(nid)
                    answered += 1
                except Exception:  # noqa: BLE001 (dead, or unreachable: a lost node)
                    self._forget(nid)
            waited = time.monotonic() - t0
            if waited >= RESTART_PING_S or (waited >= RESTART_GRACE_S and answered >= need):
                break
        for nid in pending.values():
            if nid in self.reports:
                self.silent.add(nid)
            else:
                self._forget(nid)

    def _forget(self, nid: str) -> None:
        """A node lost: its agent ended, its standby dropped; its figures remembered by its host
        for a node started again there."""
        import ray

        agent = self.agents.pop(nid, None)
        if agent is not None:
            try:
                ray.kill(agent, no_restart=True)
            except Exception:  # noqa: BLE001 (its node is gone: nothing to end)
                pass
        with self._lock:
            standby = self._standby.pop(nid, None)
        if standby is not None:
            _kill(standby[0])
        report, probe = self.reports.pop(nid, None), self.nodes.pop(nid, None)
        self.silent.discard(nid)
        if report is not None and probe is not None:
            self._gone[probe["ip"], probe["host"], probe["cores"]] = (report.layer_ms, nid)

    def _available(self) -> dict[str, NodeReport]:
        """The calibrated nodes a plan may use now: all but the silent."""
        return {nid: r for nid, r in self.reports.items() if nid not in self.silent}

    def _measure_links(self, new: list[str]) -> None:
        """Round trip and rate of every link that touches a new node, each direction, the driver
        included; one pair at a time, so that no two measurements share a link. A pair that cannot
        be measured is left out (the planner then counts it as --link-delay's figure)."""
        import ray

        from specpipe.cluster.links import ProbeServer, measure

        t0 = time.perf_counter()
        mine = ProbeServer(self.driver_ip)
        servers = {DRIVER: (mine.address, mine.port, mine.token)}
        try:
            # Not the silent: a frozen node's agent would hold each call to the timeout.
            opened = {nid: a.probe_open.remote() for nid, a in self.agents.items() if nid not in self.silent}
            for nid, ref in opened.items():
                try:
                    servers[nid] = tuple(ray.get(ref, timeout=30.0))
                except Exception as e:  # noqa: BLE001 (its links stay unmeasured)
                    self._say(f"links of node {self._name(nid)}: not measured ({type(e).__name__})")
            ends = list(servers)
            for a in ends:
                for b in ends:
                    if a == b or (a not in new and b not in new):
                        continue
                    try:
                        rtt, rate = (measure(*servers[b]) if a == DRIVER else
                                     ray.get(self.agents[a].measure.remote(*servers[b]), timeout=30.0))
                    except Exception as e:  # noqa: BLE001
                        self._say(f"link {self._end(a)} -> {self._end(b)}: not measured ({type(e).__name__})")
                        continue
                    self.links[a, b] = Link(rtt, rate)
                    self._say(f"link {self._end(a)} -> {self._end(b)}: {rtt:.2f} ms round trip, "
                              f"{8 * rate / 1e6:.1f} Mbit/s")
        finally:
            mine.close()
            for nid, a in self.agents.items():
                if nid in servers:
                    a.probe_close.remote()
        self._say(f"measured {sum(1 for k in self.links if k[0] in new or k[1] in new)} links in "
                  f"{time.perf_counter() - t0:.1f} s")

    def _end(self, nid: str) -> str:
        return "driver" if nid == DRIVER else self._name(nid)

    def _calibrate(self, node_ids: list[str]) -> None:
        """One layer of this model, its weight types and a stage's threads, timed on each node."""
        import ray

        c = self.config
        layer = self.ckpt.config.num_layers // 2
        spec = StageSpec(layer, layer + 1, False, False)
        rows = self._rows()
        t0 = time.perf_counter()
        paths = dict(zip(node_ids, self._provision_all([(nid, spec, "calibration layer") for nid in node_ids])))
        # Machines one at a time, but the nodes of one machine together: nodes that share its cores
        # (several `ray start` on one host) slow each other down while serving, so they must while
        # timed too; nodes on other machines must not be timed by a busy driver's neighbours.
        ms_of: dict[str, float] = {}
        for host in sorted({self._host(nid) for nid in node_ids}):
            group = [nid for nid in node_ids if self._host(nid) == host]
            refs = [self.agents[nid].calibrate.remote(paths[nid], layer, [rows], self.nodes[nid]["cores"], c.device,
                                                      _dtype_name(c), c.quantization) for nid in group]
            ms_of.update({nid: out[rows] for nid, out in zip(group, ray.get(refs, timeout=LOAD_TIMEOUT_S))})
        for nid in node_ids:
            ms = ms_of[nid]
            probe = self.nodes[nid]
            self.reports[nid] = NodeReport(nid, self._name(nid), probe["free_bytes"] // self._hosts_sharing(nid),
                                           ms, probe["cores"])
            self._say(f"node {self._name(nid)}: {probe['cores']} cores, {probe['free_bytes'] / 2**30:.1f} GB free, "
                      f"a layer's step {ms:.2f} ms at {rows} row{'s' if rows > 1 else ''}")
        self._say(f"calibrated {len(node_ids)} node{'s' if len(node_ids) > 1 else ''} in "
                  f"{time.perf_counter() - t0:.1f} s")

    def _rows(self) -> int:
        """The rows of a step the plan is made for: one token (latency), a tree layer (else)."""
        c = self.config
        return 1 if objective_for(c.mode) == "latency" or c.mode not in SPECULATIVE_MODES else c.tree_width

    def _host(self, nid: str) -> tuple[str, str]:
        return self.nodes[nid]["ip"], self.nodes[nid]["host"]

    def _hosts_sharing(self, nid: str) -> int:
        """Ray nodes on the same host (one machine running several `ray start`) share its memory."""
        return sum(self._host(other) == self._host(nid) for other in self.nodes)

    def _name(self, nid: str) -> str:
        p = self.nodes[nid]
        return f"{p['ip']}/{nid[:6]}"

    def _plan(self, max_stages: Optional[int] = None, stages: Optional[int] = None,
              counts: Optional[list[int]] = None) -> Plan:
        plan = plan_split(list(self._available().values()), self.model, objective_for(self.config.mode),
                          max_stages=max_stages, stages=stages, stage_layers=counts, links=self.links or None,
                          rows=self._rows(), link_ms=self.config.link_delay_ms)
        for line in plan.describe():
            self._say(line)
        return plan

    # -- weights -------------------------------------------------------------------------------
    def _provision_all(self, items: list[tuple[str, StageSpec, str]]) -> list[str]:
        """The path each (node, stage spec, label) opens on its node: the node's own copy or a
        verified cache entry, else the bytes streamed there, every node at once."""
        import ray

        from specpipe.cluster.streaming import Transfer, stream
        from specpipe.cluster.weights import stage_digest

        for _, spec, _ in items:
            if spec not in self._digests:
                sb = self.ckpt.stage_ranges(spec)
                self._digests[spec] = (sb, stage_digest(sb.root_of(self.model_path), sb))
        # find() hashes a cache entry again (seconds per GB); a node that does not answer in
        # LOAD_TIMEOUT_S fails this start (a restart plans without it if it stays silent).
        found = ray.get([self.agents[nid].find.remote(*self._digests[spec], str(self.model_path))
                         for nid, spec, _ in items], timeout=LOAD_TIMEOUT_S)
        todo: dict[tuple[str, str], Transfer] = {}  # (node, digest): one transfer, whoever asks
        keep: dict[str, set] = {}  # node -> the digests placed there now: room is made without them
        for nid, spec, _ in items:
            keep.setdefault(nid, set()).add(self._digests[spec][1])
        for (nid, spec, label), path in zip(items, found):
            sb, digest = self._digests[spec]
            if path is None and (nid, digest) not in todo:
                todo[nid, digest] = Transfer(self._name(nid), label, self.agents[nid], sb, digest,
                                             sb.root_of(self.model_path), self.config.weight_cache_max,
                                             tuple(sorted(keep[nid])))
        got = dict(zip(todo, stream(list(todo.values()), self.chunk_bytes, progress=self.progress)))
        return [path if path is not None else got[nid, self._digests[spec][1]]
                for (nid, spec, _), path in zip(items, found)]

    # -- the pipeline --------------------------------------------------------------------------
    def start(self) -> RemotePipeline:
        """Stage actors for the current plan, connected to this driver; after a failure, the plan
        again over the nodes still alive (PipelineError where nothing can host the stages)."""
        import ray

        from specpipe.cluster.weights import WeightCacheError

        try:
            return self._start()
        except (PlanError, ConfigError) as e:
            self.state = "failed"
            raise PipelineError(str(e)) from None
        except (ray.exceptions.RayError, WeightCacheError) as e:
            # A node agent lost while it took a stage's weights, a cache entry that would not
            # verify: this attempt failed (engine/restart.py tries again, re-planning without a
            # node that is gone), and the message says why in one line, not a remote traceback.
            raise PipelineError(f"placing the stages failed: {_cause_line(e)}") from None

    def _start(self) -> RemotePipeline:
        import ray

        from specpipe.cluster.placement import on_node
        from specpipe.distributed.ranks import stage_failure, wait_ready
        from specpipe.distributed.store import open_store
        from specpipe.distributed.transport import Transport

        phases: list[tuple[str, float]] = []  # (what, seconds): where a start's time goes, said at the end
        t = time.perf_counter()

        def phase(what: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases.append((what, now - t))
            t = now

        if self.state != "starting":  # a restart: who is still there
            self.restarts += 1
            self._refresh_nodes()
            phase("nodes")
            if any(s.node.node_id not in self._available() for s in self.plan.stages):
                self._say("a node of the pipeline is gone or silent: planning the split again on the nodes left")
                self.plan = self._plan(stages=len(self.plan.stages), counts=self._counts)
                phase("plan")
        c, plan = self.config, self.plan
        S, specs = len(plan.stages), plan.specs()
        paths = self._provision_all([(s.node.node_id, spec, f"stage {i + 1}")
                                     for i, (s, spec) in enumerate(zip(plan.stages, specs))])
        phase("weights")
        per_node = {nid: sum(s.node.node_id == nid for s in plan.stages) for nid in {s.node.node_id for s in plan.stages}}
        key = secrets.token_bytes(32)  # fresh for every pipeline, handed over through Ray only
        # The rendezvous: a keyed store on the driver's address, a new one for every pipeline.
        store = open_store(0, S + 1, self.driver_ip, 0, key)
        actors, refs, warm = [], [], 0
        for rank, (s, spec, path) in enumerate(zip(plan.stages, specs, paths), start=1):
            nid = s.node.node_id
            threads = max(1, self.nodes[nid]["cores"] // per_node[nid])
            actor = self._take_standby(nid)
            warm += actor is not None
            if actor is None:
                actor = _stage_actor_cls().options(**on_node(nid)).remote()
            actors.append(actor)
            refs.append(actor.serve.remote(rank, S + 1, (self.driver_ip, store.port), key, path, spec, self.num_blocks,
                                           c.block_size, c.device, _dtype_name(c), c.link(), threads, c.quantization))

        def exits() -> dict[int, str]:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            return {refs.index(ref) + 1: _ended(ref) for ref in done}

        def stop(broken: bool) -> None:
            if not broken:
                ray.wait(refs, num_returns=len(refs), timeout=5.0)
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
            store.close()

        phase(f"actors ({warm} standby)" if warm else "actors")
        tr = Transport(0, S + 1, self.driver_ip, store.port, c.link(), c.device, key=key, use_nccl=False, store=store,
                       address=self.driver_ip)
        try:
            ready = wait_ready(store, S, exits, LOAD_TIMEOUT_S, self.progress)
            phase("stages ready")
            tr.init_groups(abort=lambda: stage_failure(store, S, exits))
            phase("links")
        except BaseException as e:
            stop(broken=True)
            tr.close()
            if isinstance(e, RuntimeError):
                raise PipelineError(str(e)) from None
            raise
        self._say(f"{'restart ' + str(self.restarts) if self.state != 'starting' else 'start'}: stages up in "
                  f"{sum(s for _, s in phases):.1f} s (" + ", ".join(f"{w} {s:.1f} s" for w, s in phases) + ")")
        self.state = "running"
        self._actors = actors
        self._warm_later()
        pipe = RemotePipeline(tr, S, exits, on_close=stop)
        pipe.ready = ready  # type: ignore[attr-defined]
        return pipe

    # -- standby stage actors ------------------------------------------------------------------
    def _warm_later(self) -> None:
        """A standby on every node that lacks one, STANDBY_AFTER_S from now: not during the new
        pipeline's first steps (a restart's recomputation), whose CPU a worker's start would take."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(STANDBY_AFTER_S, self._warm_standbys)
            self._timer.daemon = True
            self._timer.start()

    def _warm_standbys(self) -> None:
        """A standby on each answering node without one that has STANDBY_MIN_FREE available: on a
        node short of memory a standby could get a stage killed (Ray's memory monitor) or the
        node's next stage refused; there a restart starts a new worker as before."""
        import ray

        from specpipe.cluster.placement import on_node

        with self._lock:
            todo = {nid: a for nid, a in self.agents.items() if nid not in self._standby and nid not in self.silent}
        probes = {nid: a.probe.remote(self.config.device) for nid, a in todo.items()}
        free: dict[str, int] = {}
        for nid, ref in probes.items():
            try:
                free[nid] = ray.get(ref, timeout=PING_S)["free_bytes"]
            except Exception:  # noqa: BLE001 (not answering: no standby there now)
                pass
        with self._lock:
            if self.state == "closed":
                return
            for nid, available in free.items():
                if nid not in self.agents or nid in self._standby:
                    continue
                if available < STANDBY_MIN_FREE:
                    self._say(f"no standby stage actor on node {self._name(nid)}: {available / 2**30:.1f} GB "
                              f"available, under {STANDBY_MIN_FREE / 2**30:.0f} GB (a restart there starts a new worker)")
                    continue
                actor = _stage_actor_cls().options(**on_node(nid)).remote()
                self._standby[nid] = (actor, actor.warm.remote())

    def _take_standby(self, nid: str):
        """The standby stage actor of node `nid` (None: there is none, or it died)."""
        import ray

        with self._lock:
            got = self._standby.pop(nid, None)
        if got is None:
            return None
        actor, ref = got
        done, _ = ray.wait([ref], timeout=0)
        if done:
            try:
                ray.get(done[0], timeout=1.0)
            except Exception:  # noqa: BLE001 (it died: a fresh actor instead)
                _kill(actor)
                return None
        return actor  # warmed, or still importing: either way sooner than a new worker process

    def close(self) -> None:
        """The node agents and standbys go too (the stage actors went with the pipeline)."""
        import ray

        with self._lock:
            self.state = "closed"
            if self._timer is not None:
                self._timer.cancel()
            standby, self._standby = list(self._standby.values()), {}
        for actor, _ in standby:
            _kill(actor)
        for agent in self.agents.values():
            try:
                ray.kill(agent)
            except Exception:  # its node is gone already
                pass
        self.agents.clear()

    def stage_pids(self) -> list[int]:
        """The stage actors' process ids, stage 1 first."""
        import ray

        return ray.get([a.ping.remote() for a in self._actors])

    def describe(self) -> list[dict]:
        """Each stage's node and layers (Engine.placement adds state and restarts)."""
        return [{"stage": i + 1, "node": s.node.name, "node_id": s.node.node_id, "layers": [s.start, s.end]}
                for i, s in enumerate(self.plan.stages)]


def _stage_actor_cls():
    import ray

    from specpipe.cluster.stage_actor import StageActor

    return ray.remote(num_cpus=0, max_concurrency=2, max_restarts=0)(StageActor)


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 (gone already)
        pass


def _ended(ref) -> str:
    """Why a stage actor's serve() ended, in one line."""
    import ray

    try:
        ray.get(ref, timeout=1.0)
        return "stopped"
    except ray.exceptions.RayActorError:
        return "actor died (its process was killed or its node was lost)"
    except ray.exceptions.RayTaskError as e:
        return f"failed: {_cause_line(e)}"
    except Exception as e:  # noqa: BLE001
        return f"ended: {type(e).__name__}"


def _cause_line(e: BaseException) -> str:
    """A Ray error in one line: for a remote exception the original's type and message (Ray's
    own text carries the remote traceback), for a lost actor what that means."""
    import ray

    if isinstance(e, ray.exceptions.RayActorError):
        return "a node agent or stage actor died (its process was killed or its node was lost)"
    cause = getattr(e, "cause", None)
    cause = cause if isinstance(cause, BaseException) else e
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__


def _dtype_name(config: EngineConfig) -> Optional[str]:
    dtype = config.torch_dtype()
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _dtype_bytes(config: EngineConfig) -> int:
    import torch

    return torch.empty(0, dtype=config.torch_dtype()).element_size()


def model_bytes(ckpt: Checkpoint, config: EngineConfig, num_blocks: int, weight_bytes: int) -> ModelBytes:
    """The model as the planner sees it: each layer's weights as stored (scaled to `weight_bytes`
    where the stages expand them, e.g. bfloat16 files run in float32), the embedding, the head,
    and a layer's KV."""
    cfg = ckpt.config
    L = cfg.num_layers

    def need(spec: StageSpec) -> int:
        return ckpt.stage_ranges(spec).total

    base = need(StageSpec(0, 0, False, False))  # headers and tables every stage reads
    layers = [need(StageSpec(i, i + 1, False, False)) - base for i in range(L)]
    embed = need(StageSpec(0, 0, True, False)) - base
    head = need(StageSpec(L, L, False, True)) - base
    stored = sum(layers) + embed + head
    scale = max(1.0, weight_bytes / max(1, stored))
    kv = num_blocks * config.block_size * cfg.kv_values_per_token * _dtype_bytes(config)
    row = cfg.hidden_size * _dtype_bytes(config)  # a hidden state between stages, as the links send it
    return ModelBytes(tuple(int(b * scale) for b in layers), int(embed * scale), int(head * scale), kv,
                      row_bytes=row)
