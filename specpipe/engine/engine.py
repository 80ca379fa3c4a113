"""The driver: loads the model's tokenizer and source, brings up the stages, and runs the engine
core for one request (`generate`) or many (`run`).

    prompt -> tokenizer -> Request -> EngineCore.add_request -> step ... step
           -> committed tokens -> Request (incremental detokenizer, stop strings) -> text
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from specpipe.config import DEFAULT_DRAFT, MODES, SPECULATIVE_MODES, ConfigError, EngineConfig
from specpipe.costs.balance import BALANCED
from specpipe.distributed.ranks import RankEnv
from specpipe.engine.core import EngineCore
from specpipe.engine.kv_pool import held_weight_bytes
from specpipe.sched.prefix_cache import PrefixCache
from specpipe.engine.prompts import PromptProcessor
from specpipe.engine.stage_plan import OnePrompt, cluster_blocks, cost_profile_of, plan_stages, reported_pools
from specpipe.engine.start_pipeline import start_pipeline
from specpipe.loader import open_checkpoint
from specpipe.loader.default_model import default_model_path
from specpipe.messages import Pipeline
from specpipe.outputs import RequestOutput
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.spec_decode.async_draft import AsyncDraft
from specpipe.spec_decode.build import build_source
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import TokenSource
from specpipe.worker.stage_worker import StageStats


class Engine:
    """Loads the model once; serves requests through one `EngineCore` per mode."""

    def __init__(self, config: EngineConfig, rank_env: Optional[RankEnv] = None,
                 progress: Optional[Callable[[str], None]] = None, one_prompt: Optional[OnePrompt] = None) -> None:
        """`one_prompt`: the one request this engine is started for (specpipe generate), whose need
        sizes the KV pools instead of --max-num-seqs full contexts (unless --kv-memory is given)."""
        config.validate()
        self.config = config
        self.model_path = Path(config.model) if config.model else default_model_path()
        self.checkpoint = open_checkpoint(self.model_path)
        cfg = self.checkpoint.config
        self.prompts = PromptProcessor.of(self.model_path, cfg, config.max_context)
        self.tokenizer, self.max_context = self.prompts.tokenizer, self.prompts.max_context
        self.cost_profile = cost_profile_of(config)
        need = None if one_prompt is None else self.prompts.need(*one_prompt)
        self.cluster = None  # --cluster ray: the nodes, the planned split, the stage actors
        blocks = None
        if config.cluster == "ray":
            from specpipe.cluster.ray_backend import RayBackend

            self.cluster = RayBackend(config, self.checkpoint, self.model_path,
                                      lambda S: cluster_blocks(config, cfg, S, need),
                                      held_weight_bytes(self.checkpoint, config), progress)
            self.config = config = self.cluster.config  # the plan's stages and layer counts
            blocks = self.cluster.num_blocks
        self.plan = plan_stages(config, self.checkpoint, self.cost_profile, need, cluster_pool=blocks)
        self.stage_specs = list(self.plan.specs)
        if config.stage_layers == BALANCED and progress is not None:
            progress(f"stages balanced by the cost profile: {','.join(map(str, self.plan.layer_counts))} layers")
        self.num_blocks, self.window_blocks, whole_blocks = self.plan.pools
        # A draft model holds what a stage holds plus the layers it drafted ahead of the rows sent
        # (up to one speculative reserve per running request): room for that, so it rarely runs out.
        # It keeps whole contexts in one pool: sized as the stages' pool would be without a window
        # pool (with one the stages hold longer contexts than that, and a draft short of room only
        # stops speculating for a while: core.draft_failed), never more memory than before.
        running = 1 if need is not None else config.max_num_seqs
        self.draft_blocks = whole_blocks + running * -(-self.plan.reserve // config.block_size)
        self.block_size = config.block_size
        self.source: Optional[TokenSource] = None
        self.async_source: Optional[AsyncDraft] = None  # the same source behind a worker thread (--draft-async)
        if config.mode in SPECULATIVE_MODES:
            self._source()  # before any process starts, so a bad --draft leaves nothing running
            if config.draft_async:
                self._async_source()
        self.pipeline: Pipeline = start_pipeline(config, self.checkpoint, self.model_path, self.plan, rank_env,
                                                 progress, self.cluster)
        cacheable = not self.window_blocks
        if rank_env is not None:
            # Each stage sized its pools from its own machine's memory (stage_plan.reported_pools).
            self.num_blocks, self.window_blocks, cacheable = reported_pools(self.plan.pools, self.pipeline.ready)
        if progress and (rank_env is not None or config.uses_processes() or self.cluster is not None):  # with the stages' own lines
            window = (f"; sliding-window layers: {self.window_blocks} blocks "
                      f"({self.window_blocks * self.block_size} tokens)" if self.window_blocks else "")
            progress(f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens per stage "
                     f"({self.num_blocks * self.block_size} tokens){window}")
        self._pids = itertools.count()  # shared by every core: the stages see one id space
        # One prefix cache for every core, since they share the stages' pools. A sliding-window
        # pool forgets what the window has passed, so there a block cannot be reused.
        self.prefix_cache = PrefixCache(self.block_size) if config.enable_prefix_caching and cacheable else None
        if progress and config.enable_prefix_caching and not cacheable:
            progress("prefix caching is off: the sliding-window layers keep a pool that forgets old positions")
        self._cores: dict[tuple, EngineCore] = {}
        self._stage_before: list[dict] = []  # the stages' counters when the last generate() began
        self._kernels: Optional[dict] = None

    def _source(self) -> TokenSource:
        if self.source is None:
            c = self.config
            self.source = build_source(c.draft or DEFAULT_DRAFT, self.checkpoint, self.tokenizer,
                                       self.draft_blocks, self.block_size, c.device, c.torch_dtype(),
                                       c.quantization, c.draft_vocab, c.draft_quantization)
            if c.enable_prefix_caching:  # the draft model keeps prompt prefixes too
                for s in getattr(self.source, "sources", [self.source]):
                    if isinstance(s, DraftModelSource):
                        s.enable_prefix_cache(PrefixCache(self.block_size))
        return self.source

    def _async_source(self) -> AsyncDraft:
        """The source behind its own worker thread (--draft-async), made once."""
        if self.async_source is None:
            self.async_source = AsyncDraft(self._source())
        return self.async_source

    def core(self, mode: Optional[str] = None, tree_width: Optional[int] = None,
             tree_depth: Optional[int] = None, layers_per_step: Optional[int] = None,
             draft_async: Optional[bool] = None) -> EngineCore:
        """The engine core for a mode (the config's by default). Cores share the stages, so only
        one may have requests at a time."""
        c = self.config
        key = (mode or c.mode, tree_width or c.tree_width, tree_depth or c.tree_depth,
               layers_per_step or c.layers_per_step, c.draft_async if draft_async is None else draft_async)
        if key[0] not in MODES:
            raise ConfigError(f"unknown mode {key[0]!r}; choose one of {', '.join(MODES)}")
        busy = [k for k, core in self._cores.items() if k != key and core.has_work()]
        if busy:
            raise RuntimeError(f"the engine is still serving requests in mode {busy[0][0]}")
        if self.async_source is not None and not key[4]:  # the draft is a sync core's only once its queue has run
            self.async_source.drain()
        if key not in self._cores:
            source = None
            if key[0] in SPECULATIVE_MODES:
                source = self._async_source() if key[4] else self._source()
            self._cores[key] = EngineCore(
                self.pipeline, key[0], source, width=key[1], depth=key[2], layers=key[3], kv_blocks=self.num_blocks,
                block_size=self.block_size, max_num_seqs=c.max_num_seqs, step_rows=c.max_step_rows,
                max_waiting=c.max_waiting, max_waiting_per_client=c.max_waiting_per_client, pids=self._pids,
                cost_profile=self.cost_profile, stage_layers=[s.end - s.start for s in self.stage_specs],
                window_pool=(self.checkpoint.config.sliding_window, self.window_blocks) if self.window_blocks else None,
                prefix_cache=self.prefix_cache)
        return self._cores[key]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix nobody reads now, the stages' (they free their blocks with
        the next step) and the draft model's, e.g. so that one benchmark run does not start from
        another's cache: a warm draft alone would make its drafting faster than a cold run's."""
        if self.prefix_cache is not None:
            self.prefix_cache.evict(len(self.prefix_cache))
        if self.async_source is not None:
            self.async_source.drain()  # the draft is its worker's until the queue has run
        for s in getattr(self.source, "sources", [self.source]):
            prefix = getattr(s, "prefix", None) if isinstance(s, DraftModelSource) else None
            if prefix is not None:
                prefix.make_room(prefix.available())  # room for everything: every unread block goes

    def run(self, requests: Iterable[Request], core: Optional[EngineCore] = None,
            on_finish: Optional[Callable[[Request], None]] = None) -> None:
        """Serve `requests` together until all have finished (see EngineCore.run)."""
        (core or self.core()).run(requests, on_finish)

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                 chat: Optional[bool] = None, on_text: Optional[Callable[[str], None]] = None,
                 mode: Optional[str] = None, tree_width: Optional[int] = None,
                 tree_depth: Optional[int] = None, layers_per_step: Optional[int] = None,
                 ignore_eos: bool = False, draft_async: Optional[bool] = None) -> RequestOutput:
        """Decode one request. `mode`, `tree_width`, `tree_depth` and `layers_per_step` override the
        config for this request (so one set of stage processes can serve every mode, e.g. in
        benchmarks), as `draft_async` does --draft-async; `ignore_eos` decodes up to max_tokens whatever the model says."""
        req = self.prompts.make_request(prompt, sampling, chat, on_text, ignore_eos)
        core = self.core(mode, tree_width, tree_depth, layers_per_step, draft_async)
        # The stages' counters ride on the step that delivers the release: no extra step.
        self.run([req], core, on_finish=lambda _req: core.request_stage_stats())
        stages = _stage_deltas(self._stage_before, core.stage_stats or [])
        self._stage_before = core.stage_stats or []
        stats = req.summary(self.pipeline.num_stages)
        stats.update(mode=core.mode, draft=core.source.name if core.source is not None else None,
                     seed=req.sampling.seed, stages=stages, kernels=self.kernel_report())
        return RequestOutput.of(req, stats, prompt if isinstance(prompt, str) else None)

    def kernel_report(self) -> dict:
        """What the stages compute with, as this (the driver's) process sees it: the kernel per
        weight type and the native library's ISA path. Local stages load the same library by the
        same choice; a stage on another machine (torchrun, --cluster ray) chooses on its own and
        may differ (seen_by says whose view this is)."""
        if self._kernels is None:
            self._kernels = kernel_report(self.checkpoint, self.config.device, self.config.quantization)
        return self._kernels

    def placement(self) -> list[dict]:
        """Each stage's node, layers, state and the stages' restarts (for /health and /metrics)."""
        if self.cluster is not None:
            stages = self.cluster.describe()
        else:
            node = "local" if self.config.uses_processes() or self.pipeline.num_stages == 1 else "in-process"
            stages = [{"stage": i + 1, "node": node, "layers": [s.start, s.end]} for i, s in enumerate(self.stage_specs)]
        failed = getattr(self.pipeline, "failed", None)
        for d in stages:
            d.update(state="failed" if failed else "running", restarts=getattr(self.pipeline, "restarted", 0))
        return stages

    def close(self) -> None:
        self.prompts.close()
        if self.async_source is not None:
            self.async_source.close()
        self.pipeline.close()
        if self.cluster is not None:
            self.cluster.close()


def _stage_deltas(before: list[dict], after: list[dict]) -> list[dict]:
    """Per-stage figures for one request: cumulative counters differenced, per-step means added."""
    out = []
    for i, a in enumerate(after):
        d = dict(a)
        b = before[i] if i < len(before) else {}
        for k in StageStats.CUMULATIVE:
            d[k] = a[k] - b.get(k, 0)
        steps = max(d["steps"], 1)
        d["compute_ms_per_step"] = d["compute_s"] / steps * 1e3
        d["wait_ms_per_step"] = d["wait_s"] / steps * 1e3
        d["bytes_per_step"] = d["bytes_sent"] / steps
        d["occupancy"] = d["rows_committed"] / d["rows_computed"] if d["rows_computed"] else None
        out.append(d)
    return out


def kernel_report(ckpt, device: str, quantization: Optional[str]) -> dict:
    """{"weights": {weight type: kernel}, "native_isa": the native library's path or None,
    "native_library": "loaded" or why not, "seen_by": "driver"} (Engine.kernel_report)."""
    from specpipe.kernels import native
    from specpipe.model.stage import weight_kernels

    lib = native.describe()
    return {"weights": weight_kernels(ckpt, device, quantization), "native_isa": lib["isa"],
            "native_library": "loaded" if lib["loaded"] else lib["problem"], "seen_by": "driver"}
