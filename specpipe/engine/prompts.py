"""Prompts into validated requests: chat template, tokenization, the checks a request must pass
before it reaches the engine core (not empty, token ids in the vocabulary, prompt plus
`max_tokens` within the context), a concrete seed and an incremental detokenizer."""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

from specpipe.config import ConfigError
from specpipe.grammar.compiler import GrammarCompiler
from specpipe.grammar.matcher import RequestGrammar
from specpipe.request import Request, RequestText
from specpipe.sampling import SamplingParams
from specpipe.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer


class PromptError(ConfigError):
    """A prompt the model cannot take: empty, or token ids outside its vocabulary (a server
    answers it as a bad `prompt`)."""


class PromptProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_context: int) -> None:
        self.tokenizer, self.vocab_size, self.max_context = tokenizer, vocab_size, max_context
        self._ids = itertools.count()
        self._grammars: Optional[GrammarCompiler] = None

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model (built on first use: about a second)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    def close(self) -> None:
        """Stop the grammar compiler's child process, if one was started."""
        if self._grammars is not None:
            self._grammars.close()

    @classmethod
    def of(cls, model_path, cfg, max_context: int) -> "PromptProcessor":
        """The model's tokenizer, its vocabulary, and a context of at most what it was trained for."""
        return cls(Tokenizer.from_path(model_path), cfg.vocab_size, min(max_context, cfg.max_position))

    def encode_prompt(self, prompt: str, chat: Optional[bool] = None) -> list[int]:
        use_chat = self.tokenizer.has_chat_template if chat is None else chat
        if use_chat:
            if not self.tokenizer.has_chat_template:
                raise ConfigError("--chat: this model has no chat template; use --no-chat")
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict], tools: Optional[list[dict]] = None,
                    template_kwargs: Optional[dict] = None) -> list[int]:
        """`tools`: OpenAI tool definitions, for a template that renders them (Qwen2.5's).
        `template_kwargs`: more variables for the template (vLLM's chat_template_kwargs)."""
        if not self.tokenizer.has_chat_template:
            raise ConfigError("this model has no chat template; pass plain prompts instead")
        text = self.tokenizer.apply_chat_template(messages, **{**(template_kwargs or {}),
                                                               **({"tools": tools} if tools else {})})
        # The template already holds the special tokens (BOS included where the model has one).
        return self.tokenizer.encode(text, add_special_tokens=False)

    def need(self, prompt: str | Sequence[int], max_tokens: int, chat: Optional[bool] = None) -> int:
        """The KV slots a request of this prompt may hold, its tree aside: prompt + max tokens."""
        return (len(prompt) if not isinstance(prompt, str) else len(self.encode_prompt(prompt, chat))) + max_tokens

    def make_request(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                     chat: Optional[bool] = None, on_text: Optional[Callable[[str], None]] = None,
                     ignore_eos: bool = False, keep_special: frozenset[int] = frozenset()) -> Request:
        """A validated request (not yet added): token ids, a concrete seed, a detokenizer.
        `ignore_eos`: decode past end-of-sequence tokens, up to max_tokens (for benchmarks).
        `keep_special`: special tokens whose text stays in the output (tool-call markup)."""
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.encode_prompt(prompt, chat)
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) + sampling.max_tokens > self.max_context:
            raise ConfigError(
                f"the prompt ({len(prompt_ids)} tokens) plus --max-tokens ({sampling.max_tokens}) exceeds "
                f"the context of {self.max_context} tokens; shorten the prompt or lower --max-tokens")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise PromptError(f"prompt token ids must be in [0, {self.vocab_size}), this model's vocabulary")
        if any(t >= self.vocab_size for t, _ in sampling.logit_bias):
            raise PromptError(f"logit_bias token ids must be in [0, {self.vocab_size}), this model's vocabulary")
        stop_ids = frozenset() if ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        sampling = sampling.resolved()
        # A constraint that does not compile fails here, before the request is queued (cached).
        grammar = RequestGrammar(self.grammars.compile(sampling.structured)) if sampling.structured else None
        return Request(next(self._ids), prompt_ids, sampling, stop_ids,
                       output=RequestText(IncrementalDetokenizer(self.tokenizer, prompt_ids, keep=keep_special), sampling.stop),
                       on_text=on_text, grammar=grammar)
