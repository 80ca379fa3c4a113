"""A pipeline stage as a Ray actor: the same stage loop as a local stage process
(worker/stage_main.py serve_stage), its rendezvous the driver's keyed store
(distributed/store.py) and its links keyed by the pipeline's secret, which reaches it through
Ray's (authenticated) control plane."""

from __future__ import annotations

from typing import Optional


def normal_priority() -> None:
    """Run at niceness 0: Ray starts its workers at niceness 15 (the raylet's worker_niceness),
    meant for background tasks; a stage is every token's critical path, and at 15 it got a
    thirteenth of its share on a node that also ran other work (pp decode 30 ms -> ~1 s a token
    seen on a loaded 2-core machine). Lowering niceness needs CAP_SYS_NICE (root, or a raised
    RLIMIT_NICE): without it the stage stays at Ray's niceness; `RAY_worker_niceness=0` in the
    environment of `ray start` sets it for every worker of the node."""
    import os

    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


class StageActor:
    def ping(self) -> int:
        import os

        return os.getpid()

    def warm(self) -> int:
        """A standby's preparation (cluster/ray_backend.py): import what `serve` needs (torch,
        the stage's model, loader and transport: seconds of a restart otherwise), at the niceness
        Ray gave the worker, so it takes CPU only that running stages leave."""
        import os

        import torch  # noqa: F401

        import specpipe.distributed.store  # noqa: F401
        import specpipe.distributed.transport  # noqa: F401
        import specpipe.loader  # noqa: F401
        import specpipe.model.stage  # noqa: F401
        import specpipe.worker.stage_main  # noqa: F401

        return os.getpid()

    def serve(self, rank: int, world_size: int, store_address: tuple[str, int], key: bytes, model_path: str, spec, num_blocks: int,
              block_size: int, device: str, dtype: Optional[str], link, threads: int,
              quantization: Optional[str] = None) -> None:
        """Serve stage `rank` until the driver shuts the pipeline down (returns) or a link fails
        (raises; the driver names the stage from the notes in the rendezvous)."""
        normal_priority()  # first: a standby still importing goes on at a stage's priority
        import ray
        import torch

        from specpipe.distributed.store import StoreClient
        from specpipe.distributed.transport import Transport
        from specpipe.worker.stage_main import serve_stage

        from specpipe.cluster.weights import hold_entry

        # The cache entry stays in use while this stage serves: no transfer evicts it (weights.py).
        held = hold_entry(model_path)
        try:
            torch.set_num_threads(max(1, threads))
            host, port = store_address
            serve_stage(rank, lambda: Transport(rank, world_size, host, port, link, device, key=key, use_nccl=False,
                                                store=StoreClient(host, port, key, rank),
                                                address=ray.util.get_node_ip_address()),
                        model_path, spec, num_blocks, block_size, device, getattr(torch, dtype) if dtype else None,
                        quantization)
        finally:
            if held is not None:
                held.close()
