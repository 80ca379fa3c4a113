"""Bringing up the stages for the driver, one of three ways, each giving a `Pipeline`
(messages.py): in this process (worker/local_pipeline.py: LocalPipeline, exact lock-step), as
local stage processes, or as the other ranks of a torchrun job (both
distributed/remote_pipeline.py: RemotePipeline). The third implementation, the oracle pipeline
of step-count benchmarks, lives with the simulator (sim/oracle_pipeline.py)."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from specpipe import cpus
from specpipe.config import EngineConfig, LinkOptions, StageSpec
from specpipe.distributed.ranks import LocalStages, RankEnv, load_cluster_key, stage_failure, wait_ready
from specpipe.distributed.remote_pipeline import PipelineError, RemotePipeline
from specpipe.distributed.transport import Transport
from specpipe.engine.kv_pool import KVPools
from specpipe.engine.restart import RestartingPipeline
from specpipe.engine.stage_plan import OnePrompt, StagePlan, cost_profile_of, plan_stages
from specpipe.loader import Checkpoint
from specpipe.messages import Pipeline
from specpipe.model.stage import build_stage
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_main import stage_argv, stage_process_main
from specpipe.worker.stage_worker import StageWorker

Progress = Optional[Callable[[str], None]]


def start_pipeline(config: EngineConfig, ckpt: Checkpoint, model_path: Path, plan: StagePlan,
                   rank_env: Optional[RankEnv] = None, progress: Progress = None, cluster=None) -> Pipeline:
    """The pipeline the config asks for, its stages as `plan` says (stage_plan.py): stage actors
    on a Ray cluster (`cluster`: its RayBackend, which places the plan's stages), torchrun ranks
    when this process is rank 0 of a job (each rank plans its own stage), local stage processes
    (`--transport processes`, the default when S > 1), else in-process."""
    specs, (num_blocks, window_blocks, _) = list(plan.specs), plan.pools
    if cluster is not None:
        # Ray places the stages, so the driver can start them again, elsewhere if a node is lost.
        return RestartingPipeline(cluster.start, config.restart_stages, progress) if config.restart_stages \
            else cluster.start()
    if rank_env is not None:
        return torchrun_driver(rank_env, config.stages, config.device, config.link(), progress=progress,
                               key=load_cluster_key(config.cluster_key_file, required_for="a torchrun job"))
    if config.uses_processes():
        def start() -> RemotePipeline:
            return local_processes(model_path, specs, num_blocks, config.block_size, config.device,
                                   config.torch_dtype(), config.link(), progress=progress,
                                   threads=config.stage_threads, quantization=config.quantization,
                                   window_blocks=window_blocks, key=load_cluster_key(config.cluster_key_file))
        # The driver owns local stages, so it can start them again when one dies (engine/restart.py).
        return RestartingPipeline(start, config.restart_stages, progress) if config.restart_stages else start()
    return in_process(ckpt, specs, num_blocks, config.block_size, config.device, config.torch_dtype(),
                      config.quantization, window_blocks)


def in_process(ckpt: Checkpoint, specs: list[StageSpec], num_blocks: int, block_size: int, device: str,
               dtype: Optional[torch.dtype], quantization: Optional[str] = None,
               window_blocks: int = 0) -> LocalPipeline:
    return LocalPipeline([StageWorker(build_stage(ckpt, s, device, dtype, quantization), num_blocks, block_size,
                                      window_blocks=window_blocks) for s in specs])


def local_stage_cpus(num_stages: int, threads: int = 0, device: str = "cpu") -> tuple[Optional[list[list[int]]], int]:
    """(each local stage's CPUs, or None where they run unpinned; threads per stage). The stages
    share out the CPUs this process may use (cpus.py: its affinity mask and cgroup quota),
    disjoint, where there are enough for every stage and one more for the driver's step loop and
    draft thread (with none left, pinning measured slower: cpus.py); `threads` (--stage-threads,
    0: as many as its cores, or the usable CPUs / stages) per stage. A GPU's stages are not
    pinned: their CPU threads mostly wait for the device."""
    b = cpus.budget()
    cores = cpus.stage_cores(num_stages, b.cpus[:b.threads] if b.cpus else None, threads) \
        if device == "cpu" else None
    if not threads:
        threads = len(cores[0]) if cores else max(1, b.threads // num_stages)
    return cores, threads


def local_processes(model_path: Path, specs: list[StageSpec], num_blocks: int, block_size: int, device: str,
                    dtype: torch.dtype, link: LinkOptions, load_timeout_s: float = 600.0,
                    progress: Progress = None, threads: int = 0,
                    quantization: Optional[str] = None, window_blocks: int = 0,
                    key: Optional[bytes] = None) -> RemotePipeline:
    """Start one process per stage on this machine; the caller's process is the driver.
    `threads`: CPU threads per stage (0: the machine's cores shared out among the stages);
    `key`: the pipeline's secret (--cluster-key-file; default: a fresh one for every pipeline,
    so a restarted one has a new key). The rendezvous listens on loopback only."""
    S = len(specs)
    use_nccl = device.startswith("cuda") and torch.cuda.device_count() >= S
    key = key or secrets.token_bytes(32)
    t = Transport(0, S + 1, "127.0.0.1", 0, link, device, key=key, use_nccl=use_nccl)
    port = t.store.port
    cores, threads = local_stage_cpus(S, threads, device)
    stages = LocalStages(
        "specpipe.worker.stage_main",
        lambda r: stage_argv(r, S + 1, "127.0.0.1", port, str(model_path), specs[r - 1], num_blocks, block_size,
                             device, dtype, link, threads, quantization, window_blocks),
        S, key, cores)
    try:
        ready = wait_ready(t.store, S, stages.exits, load_timeout_s, progress)
        t.init_groups(abort=lambda: stage_failure(t.store, S, stages.exits))
    except BaseException as e:
        stages.stop(grace_s=0.0)
        t.close()
        if isinstance(e, RuntimeError):  # LinkError included
            raise PipelineError(str(e)) from None
        raise
    # After a failure or an interrupted step the stages cannot be told to stop: end them at once.
    pipe = RemotePipeline(t, S, stages.exits, on_close=lambda broken: stages.stop(grace_s=0.0 if broken else 5.0))
    pipe.ready = ready  # type: ignore[attr-defined]
    return pipe


def torchrun_driver(env: RankEnv, num_stages: int, device: str, link: LinkOptions,
                    load_timeout_s: float = 600.0, progress: Progress = None, *,
                    key: bytes) -> RemotePipeline:
    """Rank 0 of a torchrun job: the stages are the other ranks, possibly on other machines;
    `key` (--cluster-key-file): the secret every link must prove it holds."""
    if env.world_size != num_stages + 1:
        raise PipelineError(f"--stages {num_stages} needs {num_stages + 1} ranks (a driver and one per "
                            f"stage), but the job has WORLD_SIZE={env.world_size}")
    t = Transport(0, env.world_size, env.master_addr, env.master_port, link, device, key=key)
    try:
        ready = wait_ready(t.store, num_stages, dict, load_timeout_s, progress)
        t.init_groups(abort=lambda: stage_failure(t.store, num_stages, dict))
    except RuntimeError as e:  # LinkError included
        t.close()
        raise PipelineError(str(e)) from None
    pipe = RemotePipeline(t, num_stages)
    pipe.ready = ready  # type: ignore[attr-defined]
    return pipe


def torchrun_stage(env: RankEnv, model_path: Path, specs: list[StageSpec], pools: KVPools, block_size: int,
                   device: str, dtype: Optional[torch.dtype], link: LinkOptions,
                   quantization: Optional[str] = None, *, key: bytes) -> int:
    """Ranks 1..S of a torchrun job: serve one stage until the driver shuts the pipeline down."""
    if not 1 <= env.rank <= len(specs):
        print(f"specpipe: rank {env.rank} has no stage (--stages {len(specs)})", file=sys.stderr)
        return 2
    stage_process_main(env.rank, env.world_size, env.master_addr, env.master_port, str(model_path),
                       specs[env.rank - 1], pools.blocks, block_size, device, dtype, link,
                       quantization=quantization, window_blocks=pools.window_blocks, key=key)
    return 0


def serve_stage_rank(config: EngineConfig, env: RankEnv, one_prompt: Optional[OnePrompt] = None) -> int:
    """A stage rank under torchrun: plan the stages as the driver does, load this rank's layers
    and serve until the driver stops. Its pool is what this machine's memory allows (shared with
    the other ranks on it), or what `one_prompt` needs; the driver admits against the smallest
    pool any stage reports."""
    from specpipe.engine.prompts import PromptProcessor
    from specpipe.loader import open_checkpoint
    from specpipe.loader.default_model import default_model_path

    key = load_cluster_key(config.cluster_key_file, required_for="a torchrun job")  # before any loading
    path = config.model or str(default_model_path())
    ckpt = open_checkpoint(path)
    need = None if one_prompt is None else PromptProcessor.of(path, ckpt.config, config.max_context).need(*one_prompt)
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", config.stages))
    plan = plan_stages(config, ckpt, cost_profile_of(config), need, sharing=sharing)
    return torchrun_stage(env, path, list(plan.specs), plan.pools, config.block_size, config.device,
                          config.torch_dtype(), config.link(), config.quantization,
                          key=key)


__all__ = ["start_pipeline", "in_process", "local_processes", "torchrun_driver", "torchrun_stage", "serve_stage_rank"]
