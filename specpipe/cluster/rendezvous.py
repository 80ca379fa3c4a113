"""The rendezvous of a pipeline on Ray: a small key-value actor in place of an open TCP store.

The ranks publish their link addresses, readiness, errors and heartbeats here (the same keys as
torchrun's store: distributed/transport.py, distributed/ranks.py). It is reached only through
Ray's control plane, which a cluster started with RAY_AUTH_MODE=token authenticates, so no port of
ours is open to claim a rank or forge a readiness report. One actor per pipeline: a restarted
pipeline starts from an empty store, as a restarted local one starts from a new TCPStore.
"""

from __future__ import annotations

import time
from typing import Optional

POLL_S = 0.01


class Rendezvous:
    """The actor's class (made a Ray actor by `RayStore.create`)."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self._values[key] = value

    def get(self, key: str) -> Optional[str]:
        return self._values.get(key)

    def has(self, keys: list[str]) -> bool:
        return all(k in self._values for k in keys)


class RayStore:
    """The rendezvous seen as the store interface the transport uses (set / get / check)."""

    def __init__(self, handle, timeout_s: float = 300.0) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    @staticmethod
    def create(node_id: Optional[str] = None) -> "RayStore":
        """A new rendezvous, on `node_id` (the driver's node) where given."""
        import ray

        from specpipe.cluster.placement import on_node

        actor = ray.remote(num_cpus=0, max_concurrency=64)(Rendezvous)
        return RayStore(actor.options(**on_node(node_id)).remote() if node_id else actor.remote())

    def clone(self) -> "RayStore":
        return RayStore(self.handle, self.timeout_s)

    def set(self, key: str, value) -> None:
        import ray

        ray.get(self.handle.set.remote(key, value.decode() if isinstance(value, bytes) else str(value)))

    def check(self, keys: list[str]) -> bool:
        import ray

        return bool(ray.get(self.handle.has.remote(list(keys))))

    def get(self, key: str) -> bytes:
        """The value, once some rank has set it (as TCPStore.get waits)."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        while True:
            value = ray.get(self.handle.get.remote(key))
            if value is not None:
                return value.encode()
            if time.monotonic() > deadline:
                raise RuntimeError(f"rendezvous: no {key!r} within {self.timeout_s:.0f} s")
            time.sleep(POLL_S)

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.handle)
        except Exception:  # already gone with its node
            pass
