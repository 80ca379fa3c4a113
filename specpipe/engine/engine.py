"""The driver: tokenizer, pipeline, speculative source, and the decode loop of each mode.

    prompt -> tokenizer -> Request -> decode_<mode>(pipeline, request, source)
           -> committed tokens -> incremental detokenizer -> text
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from specpipe.config import DEFAULT_DRAFT, MODES, ConfigError, EngineConfig
from specpipe.distributed.launch import RankEnv
from specpipe.distributed.transport import LinkOptions
from specpipe.engine import launcher
from specpipe.engine.decode_rounds import decode_rounds
from specpipe.engine.decode_specpipe import decode_specpipe
from specpipe.engine.default_model import default_model_path
from specpipe.engine.sources import build_source
from specpipe.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.messages import Pipeline
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.spec_decode.sources import TokenSource



def decode(pipe: Pipeline, req: Request, mode: str, source: Optional[TokenSource] = None,
           width: int = 8, depth: int = 4) -> None:
    """Run one request to completion in `mode` (its tokens land in `req`)."""
    if mode == "pp":
        decode_rounds(pipe, req)
    elif mode == "tree":
        decode_rounds(pipe, req, source, depth, width)
    elif mode == "specpipe":
        decode_specpipe(pipe, req, source, width)
    else:
        raise ConfigError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


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
    """Loads the model once and serves generate() calls one request at a time."""

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
        self.source: Optional[TokenSource] = None
        if config.mode != "pp":
            self._source()  # before any process starts, so a bad --draft leaves nothing running
        dtype, slots = config.torch_dtype(), config.num_slots()
        if rank_env is not None:
            self.pipeline: Pipeline = launcher.torchrun_driver(rank_env, config.stages, config.device,
                                                               config.link(), progress=progress)
        elif config.uses_processes():
            self.pipeline = launcher.local_processes(self.model_path, self.stage_specs, slots, config.device,
                                                     dtype, config.link(), progress=progress)
        else:
            self.pipeline = launcher.in_process(self.checkpoint, self.stage_specs, slots, config.device, dtype)
        self._ids = itertools.count()

    def _source(self) -> TokenSource:
        if self.source is None:
            c = self.config
            self.source = build_source(c.draft or DEFAULT_DRAFT, self.checkpoint, self.tokenizer,
                                       c.num_slots(), c.device, c.torch_dtype())
        return self.source

    def encode_prompt(self, prompt: str, chat: Optional[bool] = None) -> list[int]:
        use_chat = self.tokenizer.has_chat_template if chat is None else chat
        if use_chat:
            if not self.tokenizer.has_chat_template:
                raise ConfigError("--chat: this model has no chat template; use --no-chat")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            # The template already holds the special tokens (BOS included where the model has one).
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                 chat: Optional[bool] = None, on_text: Optional[Callable[[str], None]] = None,
                 mode: Optional[str] = None, tree_width: Optional[int] = None,
                 tree_depth: Optional[int] = None) -> GenerationResult:
        """Decode one request. `mode`, `tree_width` and `tree_depth` override the config for this
        request (so one set of stage processes can serve every mode, e.g. in benchmarks)."""
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
        sampling = sampling.resolved()
        detok = IncrementalDetokenizer(self.tokenizer)
        pieces: list[str] = []

        def on_token(tok: int) -> None:
            piece = detok.add(tok)
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        stages_before = self.pipeline.stage_stats()
        req = Request(next(self._ids), prompt_ids, sampling, frozenset(self.tokenizer.eos_token_ids), on_token)
        c = self.config
        mode = mode or c.mode
        width, depth = tree_width or c.tree_width, tree_depth or c.tree_depth
        decode(self.pipeline, req, mode, None if mode == "pp" else self._source(), width, depth)
        tail = detok.flush()
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        stats = req.summary(self.pipeline.num_stages)
        stats.update(mode=mode, draft=self.source.name if mode != "pp" else None,
                     seed=sampling.seed, stages=_stage_deltas(stages_before, self.pipeline.stage_stats()))
        return GenerationResult("".join(pieces), prompt_ids, list(req.output_ids), req.finish_reason or "length", stats)

    def close(self) -> None:
        self.pipeline.close()


_CUMULATIVE = ("steps", "compute_s", "wait_s", "bytes_sent", "rows_computed", "rows_committed")


def _stage_deltas(before: list[dict], after: list[dict]) -> list[dict]:
    """Per-stage figures for one request: cumulative counters differenced, per-step means added."""
    out = []
    for b, a in zip(before, after):
        d = dict(a)
        for k in _CUMULATIVE:
            d[k] = a[k] - b[k]
        steps = max(d["steps"], 1)
        d["compute_ms_per_step"] = d["compute_s"] / steps * 1e3
        d["wait_ms_per_step"] = d["wait_s"] / steps * 1e3
        d["bytes_per_step"] = d["bytes_sent"] / steps
        d["occupancy"] = d["rows_committed"] / d["rows_computed"] if d["rows_computed"] else None
        out.append(d)
    return out
