"""Joining the Ray cluster and pinning actors to nodes."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Optional

from specpipe.config import ConfigError

HOW_TO_START = ("start one with `ray start --head` on this machine (and `ray start --address HEAD:6379` on "
                "the others), or pass --ray-address; see the README's \"Several machines\"")


def connect(address: str = "auto") -> None:
    """Join the cluster at `address` (auto: the one this machine started or joined with `ray start`)
    from this process, once; a clear one-line error where there is none."""
    import ray

    if ray.is_initialized():
        return
    target = _bootstrap_address(address)
    if target is not None and not _reachable(target):  # ray.init would retry for minutes
        raise ConfigError(f"--cluster ray: no Ray cluster answers at {target} (--ray-address {address}); {HOW_TO_START}")
    try:
        ray.init(address=address, log_to_driver=False, logging_level="warning", configure_logging=True)
    except ConnectionError as e:
        raise ConfigError(f"--cluster ray: no Ray cluster at {address!r} ({str(e).splitlines()[0]}); "
                          f"{HOW_TO_START}") from None
    except RuntimeError as e:  # e.g. a token-authenticated cluster and no token here
        raise ConfigError(f"--cluster ray: cannot join the Ray cluster at {address!r}: "
                          f"{str(e).splitlines()[0]}") from None


def _bootstrap_address(address: str) -> Optional[str]:
    """host:port of the cluster to join: the given one, or for auto RAY_ADDRESS or the address
    `ray start` left in /tmp/ray/ray_current_cluster; None where there is none (ray.init then
    says so at once)."""
    if address not in ("auto", ""):
        return None if address.startswith(("ray://", "local")) else address
    found = os.environ.get("RAY_ADDRESS")
    if not found:
        try:
            found = Path(tempfile.gettempdir(), "ray", "ray_current_cluster").read_text().strip()
        except OSError:
            return None
    return found or None


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
