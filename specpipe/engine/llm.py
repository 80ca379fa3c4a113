"""The Python API, in vLLM's shape.

    from specpipe import LLM, SamplingParams

    with LLM(model="model.gguf", stages=4, mode="specpipe-db", draft="draft.gguf") as llm:
        for out in llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=64)):
            print(out.text, out.finish_reason, out.stats["tokens_per_step"])

(Stage processes are programs of their own: no main guard is needed, and stdin scripts work.)

`generate` takes a list of prompts (text or token ids) and runs them through the engine together;
it returns one output per prompt, in order. `chat` takes conversations ({"role", "content"}
messages). One SamplingParams for all prompts, or a list with one per prompt.
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional, Sequence, Union

from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.outputs import RequestOutput
from specpipe.request import Request
from specpipe.sampling import SamplingParams

Prompt = Union[str, Sequence[int]]
Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class LLM:
    def __init__(self, model: Optional[str] = None, *, draft: Optional[str] = None, stages: Optional[int] = None,
                 mode: str = "pp", tree_width: int = 8, tree_depth: int = 4, quiet: bool = True,
                 **options) -> None:
        """`options`: any other EngineConfig field (max_num_seqs, max_step_rows, kv_memory,
        max_context, device, dtype, stage_layers, transport, cluster="ray", ...). `stages`: 1 by
        default; with cluster="ray" at most this many, planned over the nodes (default one per node)."""
        if stages is None:
            stages = 0 if options.get("cluster") == "ray" else 1
        config = EngineConfig(model=model, draft=draft, stages=stages, mode=mode, tree_width=tree_width,
                              tree_depth=tree_depth, **options)
        progress = None if quiet else (lambda msg: print(f"specpipe: {msg}", file=sys.stderr))
        if config.device == "cpu":
            from specpipe.kernels import native

            native.report_unavailable()  # a RuntimeWarning, once per process: quiet does not hide it
        self.engine = Engine(config, progress=progress)
        # Stage processes end with this object, even when it is only garbage-collected.
        self._finalizer = weakref.finalize(self, self.engine.close)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, chat: Optional[bool] = False) -> list[RequestOutput]:
        """Complete every prompt (plain text by default; `chat=True` wraps each in the model's
        chat template, as `specpipe generate` does)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        ids = [self.engine.prompts.encode_prompt(p, chat) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(ids, [p if isinstance(p, str) else None for p in prompts], sampling_params, use_tqdm)

    def chat(self, messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several (a list of such lists)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [self.engine.prompts.encode_chat(list(conv)) for conv in conversations]
        return self._run(ids, [None] * len(ids), sampling_params, use_tqdm)

    def _run(self, prompt_ids: list[list[int]], texts: list[Optional[str]], sampling_params,
             use_tqdm: bool) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(prompt_ids))
        reqs = [self.engine.prompts.make_request(ids, p) for ids, p in zip(prompt_ids, params)]
        bar = _progress(len(reqs)) if use_tqdm and len(reqs) > 1 else None
        try:
            self.engine.run(reqs, on_finish=(lambda _r: bar.update(1)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        return [self._output(r, t) for r, t in zip(reqs, texts)]

    def _output(self, req: Request, prompt: Optional[str]) -> RequestOutput:
        stats = req.summary(self.engine.pipeline.num_stages)
        stats.update(mode=self.engine.config.mode, seed=req.sampling.seed)
        return RequestOutput.of(req, stats, prompt)

    def reset_prefix_cache(self) -> None:
        """Forget the prompt prefixes cached so far (what no request is reading)."""
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Stop the stage processes (also done when the object is garbage-collected)."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling parameters for {n} prompts; give one, or one per prompt")
    return params


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
