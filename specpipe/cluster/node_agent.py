"""One actor per node: what the node offers (memory, cores, one layer's measured speed) and its
copy of each stage's weights (cluster/weights.py), before any stage starts there.

    driver  --probe-->  free memory, cores, address
            --find(stage bytes, digest, the driver's path)-->  a local path, or None
            --begin-->  room made in the cache (least recently used entries evicted down to
              --weight-cache-max), the chunks it holds verified from an interrupted transfer (resume)
            --write(chunk, its hash) ... / finish-->  the cache entry the driver streamed
              (cluster/streaming.py; suspend: keep what landed for the next attempt)
            --calibrate(path, layer)-->  ms of one layer's step at 1 and W rows
            --probe_open / measure(peer) / probe_close-->  round trip and rate to each other node
              (cluster/links.py)
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Optional

CALIBRATION_CONTEXT = 64
CALIBRATION_REPEATS = 5


def node_cores() -> int:
    """The cores this node's processes may use (a `taskset` on `ray start` is inherited; a cgroup
    CPU quota counts too: specpipe/cpus.py)."""
    from specpipe import cpus

    return cpus.default_threads()


class NodeAgent:
    def __init__(self, cache_root: Optional[str] = None) -> None:
        from specpipe.cluster.weights import WeightCache

        self.cache = WeightCache(Path(cache_root) if cache_root else None)
        self._writers: dict = {}
        self._room = threading.Lock()

    def probe(self, device: str = "cpu") -> dict:
        import ray

        from specpipe.worker.memory import available_memory

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "free_bytes": available_memory(device), "cores": node_cores()}

    # -- weights -------------------------------------------------------------------------------
    def find(self, sb, digest: str, driver_path: str) -> Optional[str]:
        """The path a stage on this node opens: the driver's own file where this node has the same
        one (unless SPECPIPE_USE_SHARED_PATH=0 where `ray start` ran: say the path is a slow network
        share), else a verified cache entry; None: the driver must stream the bytes."""
        local = Path(driver_path)
        shared = os.environ.get("SPECPIPE_USE_SHARED_PATH", "1") != "0"  # 0: a slow network share
        found = self.cache.find(sb, digest, local if shared and local.exists() else None)
        return None if found is None else str(found)

    def begin(self, sb, digest: str, cache_max: Optional[str] = None, keep: tuple = ()) -> dict:
        """A writer for `digest`, after making room for it in the cache (--weight-cache-max
        `cache_max`; the digests in `keep`, the stages being placed now, stay). Returns "held":
        the chunks (path, offset, length) it already holds, verified (what an earlier transfer
        left here before it was cut off), and "evicted": (name, bytes) of what was removed."""
        with self._room:  # several transfers begin at once: each counts the others' bytes
            if digest in self._writers:
                self._writers.pop(digest).suspend()
            part = self.cache.weights / f".part-{digest}"
            have = sum(item.bytes for item in self.cache.items() if item.path == part)
            coming = sum(w.sb.total for w in self._writers.values())  # transfers under way, not yet on disk
            evicted = self.cache.make_room(max(0, sb.total - have), cache_max,
                                           frozenset(keep) | {digest} | set(self._writers), pending=coming)
            w = self._writers[digest] = self.cache.writer(sb, digest)
        return {"held": w.held, "evicted": [(item.path.name, item.bytes) for item in evicted]}

    def write(self, digest: str, relpath: str, offset: int, data: bytes, chunk_digest: Optional[str] = None) -> None:
        self._writers[digest].write(relpath, offset, data, chunk_digest)

    def finish(self, digest: str) -> str:
        return str(self._writers.pop(digest).finish())

    def suspend(self, digest: str) -> None:
        """The transfer stopped (the driver's error or interruption): keep what landed."""
        w = self._writers.pop(digest, None)
        if w is not None:
            w.suspend()

    def abort(self, digest: str) -> None:
        w = self._writers.pop(digest, None)
        if w is not None:
            w.abort()

    # -- links ---------------------------------------------------------------------------------
    def probe_open(self) -> tuple[str, int, bytes]:
        """A link probe server on this node's address, for the other nodes to measure against."""
        import ray

        from specpipe.cluster.links import ProbeServer

        self.probe_close()
        self._probe = ProbeServer(ray.util.get_node_ip_address())
        return self._probe.address, self._probe.port, self._probe.token

    def probe_close(self) -> None:
        probe, self._probe = getattr(self, "_probe", None), None
        if probe is not None:
            probe.close()

    def measure(self, address: str, port: int, token: bytes) -> tuple[float, float]:
        """(round trip ms, bytes/s) from this node to a probe server."""
        from specpipe.cluster.links import measure

        return measure(address, port, token)

    # -- speed ---------------------------------------------------------------------------------
    def calibrate(self, path: str, layer: int, rows: list[int], threads: int, device: str = "cpu",
                  dtype: Optional[str] = None, quantization: Optional[str] = None) -> dict[int, float]:
        """Milliseconds of one decoder layer's step (a middle stage of that one layer, through the
        stages' own code) for each row count, with the threads a stage here would use."""
        import gc

        import torch

        from specpipe.config import StageSpec
        from specpipe.costs.measure import StageTimer
        from specpipe.loader import open_checkpoint
        from specpipe.model.stage import build_stage

        from specpipe.cluster.stage_actor import normal_priority

        from specpipe.cluster.weights import hold_entry

        held = hold_entry(path)  # not evicted while timed
        normal_priority()  # timed at the priority a stage runs at
        torch.set_num_threads(max(1, threads))
        torch_dtype = getattr(torch, dtype) if dtype else None
        model = build_stage(open_checkpoint(path), StageSpec(layer, layer + 1, False, False), device, torch_dtype,
                            quantization)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        timer = StageTimer(model, [CALIBRATION_CONTEXT], rows, torch.device(device), torch_dtype or torch.float32,
                           sync, 1)
        out = {n: timer.ms(n, CALIBRATION_CONTEXT, CALIBRATION_REPEATS) for n in rows}
        del timer, model
        gc.collect()
        if held is not None:
            held.close()
        return out
