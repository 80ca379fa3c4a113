"""A pipeline stage as a Ray actor: the same stage loop as a local stage process
(worker/stage_main.py run_stage), its rendezvous through Ray and its links keyed by the
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

        from specpipe.distributed.transport import LinkError, MalformedMessage, Transport
        from specpipe.worker.stage_main import _store_note, run_stage

        torch.set_num_threads(max(1, threads))
        t = None
        try:
            t = Transport(rank, world_size, "", 0, link, device, use_nccl=False, store=store,
                          address=ray.util.get_node_ip_address(), key=key)
            run_stage(t, model_path, spec, num_blocks, block_size, device,
                      getattr(torch, dtype) if dtype else None, quantization)
        except MalformedMessage as e:
            _store_note(t, f"failed/{rank}", str(e))
            raise
        except LinkError as e:
            _store_note(t, f"lost/{rank}", str(e))  # a consequence: do not blame this stage
            raise
        except Exception as e:
            _store_note(t, f"failed/{rank}", f"{type(e).__name__}: {e}")
            raise
        finally:
            if t is not None:
                t.close()
