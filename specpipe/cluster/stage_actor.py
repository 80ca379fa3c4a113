"""A pipeline stage as a Ray actor: the same stage loop as a local stage process
(worker/stage_main.py serve_stage), its rendezvous the driver's keyed store
(distributed/store.py) and its links keyed by the pipeline's secret, which reaches it through
Ray's (authenticated) control plane."""

from __future__ import annotations

from typing import Optional


class StageActor:
    def ping(self) -> int:
        import os

        return os.getpid()

    def serve(self, rank: int, world_size: int, store_address: tuple[str, int], key: bytes, model_path: str, spec, num_blocks: int,
              block_size: int, device: str, dtype: Optional[str], link, threads: int,
              quantization: Optional[str] = None) -> None:
        """Serve stage `rank` until the driver shuts the pipeline down (returns) or a link fails
        (raises; the driver names the stage from the notes in the rendezvous)."""
        import ray
        import torch

        from specpipe.distributed.store import StoreClient
        from specpipe.distributed.transport import Transport
        from specpipe.worker.stage_main import serve_stage

        torch.set_num_threads(max(1, threads))
        host, port = store_address
        serve_stage(rank, lambda: Transport(rank, world_size, host, port, link, device, key=key, use_nccl=False,
                                            store=StoreClient(host, port, key, rank),
                                            address=ray.util.get_node_ip_address()),
                    model_path, spec, num_blocks, block_size, device, getattr(torch, dtype) if dtype else None,
                    quantization)
