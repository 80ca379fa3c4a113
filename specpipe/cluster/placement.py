"""Joining the Ray cluster and pinning actors to nodes."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Optional

from specpipe.config import ConfigError

HOW_TO_START = ("start one with `ray start --head` on this machine (and `ray start --address HEAD:6379` on "
                "the others), or pass --ray-address; see docs/cluster.md")


def connect(address: str = "auto") -> None:
    """Join the cluster at `address` (auto: the one cluster this user runs a node of on this
    machine, see _bootstrap_address) from this process, once; a clear one-line error where there
    is none or several."""
    import ray

    if ray.is_initialized():
        return
    target = _bootstrap_address(address)
    if target is not None and not _reachable(target):  # ray.init would retry for minutes
        raise ConfigError(f"--cluster ray: no Ray cluster answers at {target} (--ray-address {address}); {HOW_TO_START}")
    try:  # the address found, never "auto": Ray's own auto may pick another cluster (see above)
        ray.init(address=target or address, log_to_driver=False, logging_level="warning", configure_logging=True)
    except ConnectionError as e:
        raise ConfigError(f"--cluster ray: no Ray cluster at {address!r} ({str(e).splitlines()[0]}); "
                          f"{HOW_TO_START}") from None
    except RuntimeError as e:  # e.g. a token-authenticated cluster and no token here
        raise ConfigError(f"--cluster ray: cannot join the Ray cluster at {address!r}: "
                          f"{str(e).splitlines()[0]}") from None


def _bootstrap_address(address: str) -> Optional[str]:
    """host:port of the cluster to join: the given one, or for auto RAY_ADDRESS, else the one
    Ray cluster this user runs a node of on this machine (None where there is none: ray.init
    then says so at once).

    Why not Ray's own auto: it reads the address the last `ray start` left in
    /tmp/ray/ray_current_cluster, else takes any cluster whose processes it sees. A cluster
    started with `ray start --temp-dir DIR` leaves its address in DIR instead, so auto joined
    whatever other cluster ran on the machine, possibly another user's, and handed it the
    model and the pipeline's key. So auto decides only where that cannot happen: exactly one
    cluster of this user's here; several are refused with their temp dirs, naming --ray-address."""
    if address not in ("auto", ""):
        return None if address.startswith(("ray://", "local")) else address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    mine = local_clusters()
    if len(mine) > 1:
        found = "; ".join(f"{gcs} (temp dir {tmp})" for gcs, tmp in sorted(mine.items()))
        raise ConfigError(f"--cluster ray: several Ray clusters of yours run on this machine ({found}): pass "
                          f"--ray-address HOST:PORT (or set RAY_ADDRESS) to say which to join")
    if not mine:
        others = _ray_current_cluster()
        hint = (f" (the one at {others}, left in {tempfile.gettempdir()}/ray, is not run by you here)"
                if others else "")
        raise ConfigError(f"--cluster ray: no Ray cluster of yours runs on this machine{hint}; {HOW_TO_START}")
    return next(iter(mine))


def local_clusters() -> dict[str, str]:
    """{GCS address: temp dir} of the Ray clusters that this user runs a node of on this machine,
    read from their raylet processes' command lines (as Ray's own discovery does)."""
    import ray  # noqa: F401  (Ray ships psutil and puts it on the path)
    import psutil

    uid = os.getuid()
    found: dict[str, str] = {}
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmd, uids = proc.info["cmdline"], proc.info["uids"]
        except psutil.Error:
            continue
        if not cmd or "raylet" not in os.path.basename(cmd[0]) or uids is None or uids.real != uid:
            continue
        flags = {}
        for arg in " ".join(cmd).split(" "):
            name, _, value = arg.partition("=")
            flags.setdefault(name.replace("_", "-"), value)
        if flags.get("--gcs-address") not in (None, "", "None"):
            found[flags["--gcs-address"]] = flags.get("--temp-dir") or "?"
    return found


def _ray_current_cluster() -> Optional[str]:
    """The address the last `ray start` without --temp-dir left on this machine, if any."""
    try:
        return Path(tempfile.gettempdir(), "ray", "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def _reachable(address: str, timeout_s: float = 5.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def live_nodes() -> list[dict]:
    """The cluster's nodes that Ray believes alive (with CPU resources), in a stable order."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    return sorted(nodes, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))


def on_node(node_id: str) -> dict:
    """Actor options that place it on `node_id` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def driver_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
