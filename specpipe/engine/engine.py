"""The driver: loads the model's tokenizer and source, brings up the stages, and runs the engine
core for one request (`generate`) or many (`run`).

    prompt -> tokenizer -> Request -> EngineCore.add_request -> step ... step
           -> committed tokens -> Request (incremental detokenizer, stop strings) -> text
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from specpipe.config import (
    DEFAULT_DRAFT,
    MODES,
    SPECULATIVE_MODES,
    ConfigError,
    EngineConfig,
)
from specpipe.distributed.launch import RankEnv
from specpipe.engine import launcher
from specpipe.engine.core import EngineCore, spec_reserve
from specpipe.engine.kv_pool import pool_blocks
from specpipe.engine.main_guard import check_main_guard
from specpipe.engine.sources import build_source
from specpipe.loader import open_checkpoint
from specpipe.loader.default_model import default_model_path
from specpipe.loader.partition import partition_layers
from specpipe.messages import Pipeline
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.spec_decode.sources import TokenSource
from specpipe.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer
from specpipe.worker.stage_worker import StageStats


@dataclass
class GenerationResult:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"text": self.text, "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "stats": self.stats}


class Engine:
    """Loads the model once; serves requests through one `EngineCore` per mode."""

    def __init__(self, config: EngineConfig, rank_env: Optional[RankEnv] = None,
                 progress: Optional[Callable[[str], None]] = None) -> None:
        config.validate()
        self.config = config
        self.model_path = Path(config.model) if config.model else default_model_path()
        self.checkpoint = open_checkpoint(self.model_path)
        self.tokenizer = Tokenizer.from_path(self.model_path)
        cfg = self.checkpoint.config
        self.max_context = min(config.max_context, cfg.max_position)
        self.stage_specs = partition_layers(cfg.num_layers, config.stages, config.stage_layers)
        reserve = spec_reserve(config.mode, config.tree_width, config.tree_depth, config.stages,
                               config.layers_per_step)
        self.num_blocks = pool_blocks(config, cfg, self.stage_specs, reserve)
        self.block_size = config.block_size
        self.cost_profile = None
        if config.cost_profile is not None:
            from specpipe.costs.profile import load_profile

            try:
                self.cost_profile = load_profile(config.cost_profile)
            except ValueError as e:
                raise ConfigError(f"--cost-profile: {e}") from None
        self.source: Optional[TokenSource] = None
        if config.mode in SPECULATIVE_MODES:
            self._source()  # before any process starts, so a bad --draft leaves nothing running
        dtype = config.torch_dtype()
        if rank_env is not None:
            self.pipeline: Pipeline = launcher.torchrun_driver(rank_env, config.stages, config.device,
                                                               config.link(), progress=progress)
            # Each stage sized its pool from its own machine's memory: admit against the smallest.
            self.num_blocks = min([self.num_blocks] + [r["num_blocks"] for r in self.pipeline.ready])
        elif config.uses_processes():
            check_main_guard()  # spawn re-imports the caller's script: say so before it fails in a child
            self.pipeline = launcher.local_processes(self.model_path, self.stage_specs, self.num_blocks,
                                                     self.block_size, config.device, dtype, config.link(),
                                                     progress=progress, threads=config.stage_threads)
        else:
            self.pipeline = launcher.in_process(self.checkpoint, self.stage_specs, self.num_blocks,
                                                self.block_size, config.device, dtype)
        if progress and (rank_env is not None or config.uses_processes()):  # with the stages' own lines
            progress(f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens per stage "
                     f"({self.num_blocks * self.block_size} tokens)")
        self._ids = itertools.count()
        self._pids = itertools.count()  # shared by every core: the stages see one id space
        self._cores: dict[tuple, EngineCore] = {}
        self._stage_before: list[dict] = []  # the stages' counters when the last generate() began

    def _source(self) -> TokenSource:
        if self.source is None:
            c = self.config
            self.source = build_source(c.draft or DEFAULT_DRAFT, self.checkpoint, self.tokenizer,
                                       self.num_blocks, self.block_size, c.device, c.torch_dtype())
        return self.source

    def core(self, mode: Optional[str] = None, tree_width: Optional[int] = None,
             tree_depth: Optional[int] = None, layers_per_step: Optional[int] = None) -> EngineCore:
        """The engine core for a mode (the config's by default). Cores share the stages, so only
        one may have requests at a time."""
        c = self.config
        key = (mode or c.mode, tree_width or c.tree_width, tree_depth or c.tree_depth,
               layers_per_step or c.layers_per_step)
        if key[0] not in MODES:
            raise ConfigError(f"unknown mode {key[0]!r}; choose one of {', '.join(MODES)}")
        busy = [k for k, core in self._cores.items() if k != key and core.has_work()]
        if busy:
            raise RuntimeError(f"the engine is still serving requests in mode {busy[0][0]}")
        if key not in self._cores:
            source = self._source() if key[0] in SPECULATIVE_MODES else None
            self._cores[key] = EngineCore(
                self.pipeline, key[0], source, width=key[1], depth=key[2], layers=key[3], kv_blocks=self.num_blocks,
                block_size=self.block_size, max_num_seqs=c.max_num_seqs, step_rows=c.max_step_rows,
                max_waiting=c.max_waiting, pids=self._pids, cost_profile=self.cost_profile)
        return self._cores[key]

    # -- requests -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: Optional[bool] = None) -> list[int]:
        use_chat = self.tokenizer.has_chat_template if chat is None else chat
        if use_chat:
            if not self.tokenizer.has_chat_template:
                raise ConfigError("--chat: this model has no chat template; use --no-chat")
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise ConfigError("this model has no chat template; pass plain prompts instead")
        text = self.tokenizer.apply_chat_template(messages)
        # The template already holds the special tokens (BOS included where the model has one).
        return self.tokenizer.encode(text, add_special_tokens=False)

    def make_request(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                     chat: Optional[bool] = None, on_text: Optional[Callable[[str], None]] = None,
                     ignore_eos: bool = False) -> Request:
        """A validated request (not yet added): token ids, a concrete seed, a detokenizer.
        `ignore_eos`: decode past end-of-sequence tokens, up to max_tokens (for benchmarks)."""
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.encode_prompt(prompt, chat)
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if len(prompt_ids) + sampling.max_tokens > self.max_context:
            raise ConfigError(
                f"the prompt ({len(prompt_ids)} tokens) plus --max-tokens ({sampling.max_tokens}) exceeds "
                f"the context of {self.max_context} tokens; shorten the prompt or lower --max-tokens")
        vocab = self.checkpoint.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        stop_ids = frozenset() if ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        return Request(next(self._ids), prompt_ids, sampling.resolved(), stop_ids,
                       detokenizer=IncrementalDetokenizer(self.tokenizer), on_text=on_text)

    def run(self, requests: Iterable[Request], core: Optional[EngineCore] = None,
            on_finish: Optional[Callable[[Request], None]] = None) -> None:
        """Serve `requests` together until all have finished (see EngineCore.run)."""
        (core or self.core()).run(requests, on_finish)

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                 chat: Optional[bool] = None, on_text: Optional[Callable[[str], None]] = None,
                 mode: Optional[str] = None, tree_width: Optional[int] = None,
                 tree_depth: Optional[int] = None, layers_per_step: Optional[int] = None) -> GenerationResult:
        """Decode one request. `mode`, `tree_width`, `tree_depth` and `layers_per_step` override the
        config for this request (so one set of stage processes can serve every mode, e.g. in
        benchmarks)."""
        req = self.make_request(prompt, sampling, chat, on_text)
        core = self.core(mode, tree_width, tree_depth, layers_per_step)
        # The stages' counters ride on the step that delivers the release: no extra step.
        self.run([req], core, on_finish=lambda _req: core.request_stage_stats())
        stages = _stage_deltas(self._stage_before, core.stage_stats or [])
        self._stage_before = core.stage_stats or []
        stats = req.summary(self.pipeline.num_stages)
        stats.update(mode=core.mode, draft=core.source.name if core.source is not None else None,
                     seed=req.sampling.seed, stages=stages)
        return GenerationResult(req.text, req.prompt_ids, list(req.output_ids), req.finish_reason or "length", stats)

    def close(self) -> None:
        self.pipeline.close()


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


def decode(pipe: Pipeline, req: Request, mode: str, source: Optional[TokenSource] = None, width: int = 8,
           depth: int = 4, **core_options) -> EngineCore:
    """Run one request to completion on a given pipeline (tests and step-count benchmarks)."""
    core = EngineCore(pipe, mode, source, width=width, depth=depth, **core_options)
    core.add_request(req)
    while core.has_work():
        core.step()
    return core
