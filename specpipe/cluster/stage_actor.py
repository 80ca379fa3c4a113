"""A pipeline stage as a Ray actor: the same stage loop as a local stage process
(worker/stage_main.py serve_stage), its rendezvous through Ray and its links keyed by the
pipeline's secret, which reaches it through Ray's (authenticated) control plane."""

from __future__ import annotations

from typing import Optional


class StageActor:
    def ping(self) -> int:
        import os

        return os.getpid()

    def serve(self, rank: int, world_size: int, store, key: bytes, model_path: str, spec, num_blocks: int,
              block_size: int, device: str, dtype: Optional[str], link, threads: int,
              quantization: Optional[str] = None) -> None:
        """Serve stage `rank` until the driver shuts the pipeline down (returns) or a link fails
        (raises; the driver names the stage from the notes in the rendezvous)."""
        import ray
        import torch

        from specpipe.distributed.transport import Transport
        from specpipe.worker.stage_main import serve_stage

        torch.set_num_threads(max(1, threads))
        serve_stage(rank, lambda: Transport(rank, world_size, "", 0, link, device, use_nccl=False, store=store,
                                            address=ray.util.get_node_ip_address(), key=key),
                    model_path, spec, num_blocks, block_size, device, getattr(torch, dtype) if dtype else None,
                    quantization)
