"""Constraints compiled for one tokenizer, with llguidance, and cached.

Building llguidance's view of a vocabulary takes about a second (once per tokenizer and process).
A constraint seen for the first time is checked in a child process under a deadline
(sandbox.py: conversion, validation, the matcher and a probe of it, all bounded), so one that is
too slow, too large, or that gives up on what it allows is a `GrammarSpecError` (a 400) before
its request is queued, and no thread of the server is held. The checked grammar is then built
here and cached by the constraint: at most `CACHE_SIZE` of them and `CACHE_CHARS` of grammar
text, least recently used first out, so a server that sees the same schema again compiles it once
and one that sees many different ones keeps a bounded memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import llguidance

from specpipe.grammar import sandbox
from specpipe.sampling import GrammarSpecError, StructuredOutput
from specpipe.tokenizer.tokenizer import Tokenizer

CACHE_SIZE = 256
CACHE_CHARS = 32 << 20  # llguidance grammar text held by the cache, over all its entries
COMPILE_TIMEOUT_S = 10.0  # a constraint's first compilation (sandbox.py) ends with a 400 after this


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked grammar for one tokenizer: what a request's matcher is made from."""

    spec: StructuredOutput
    grammar: str  # llguidance's grammar text
    tokenizer: llguidance.LLTokenizer
    vocab_size: int  # the model's logits width the masks cover
    # A matcher in its initial state, built once (llguidance builds the lexer and parser tables
    # when a matcher is made: up to a second for a large grammar); requests get copies of it.
    _prototype: list = field(default_factory=list, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def matcher(self) -> llguidance.LLMatcher:
        with self._lock:
            if not self._prototype:
                m = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0, limits=sandbox.limits())
                if m.is_error():
                    raise GrammarSpecError(f"{self.spec.kind}: {m.get_error()}")
                self._prototype.append(m)
            return self._prototype[0].deep_copy()


def _spec_text(spec: StructuredOutput) -> str:
    """What the child converts (json_object needs none)."""
    return spec.json_schema or spec.regex or spec.grammar or ""


class GrammarCompiler:
    """Compiles constraints for one tokenizer and a model whose logits are `vocab_size` wide."""

    _tokenizers: dict[tuple[str, int], llguidance.LLTokenizer] = {}
    _tokenizers_lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer, self.vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._cache_chars = 0
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._sandbox: sandbox.Sandbox | None = None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built once per tokenizer and process."""
        if self._ll is None:
            key = (self.tokenizer.fingerprint(), self.vocab_size)
            with self._tokenizers_lock:
                if key not in self._tokenizers:
                    n = max(self.vocab_size, self.tokenizer.vocab_size)
                    self._tokenizers[key] = llguidance.LLTokenizer(
                        self.tokenizer._backend.to_str(), n_vocab=n, eos_token=list(self.tokenizer.eos_token_ids))
                self._ll = self._tokenizers[key]
        return self._ll

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The checked grammar for `spec` (cached); GrammarSpecError when it does not compile,
        passes a limit, or gives up on what it allows (sandbox.py)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            text = self._checker().check(spec.kind, _spec_text(spec))
        except sandbox.SandboxError as e:
            raise GrammarSpecError(f"{spec.kind}: {e}") from None
        compiled = CompiledGrammar(spec, text, self.ll_tokenizer(), self.vocab_size)
        compiled.matcher()  # built from the checked text: as the child built it, within its deadline
        with self._lock:
            if spec not in self._cache:
                self._cache[spec] = compiled
                self._cache_chars += len(text)
            while len(self._cache) > CACHE_SIZE or (self._cache_chars > CACHE_CHARS and len(self._cache) > 1):
                _, old = self._cache.popitem(last=False)
                self._cache_chars -= len(old.grammar)
        return compiled

    def close(self) -> None:
        """Stop the child process (a compilation in progress ends with a GrammarSpecError)."""
        with self._lock:
            box, self._sandbox = self._sandbox, None
        if box is not None:
            box.close()

    def _checker(self) -> sandbox.Sandbox:
        with self._lock:
            if self._sandbox is None:
                n = max(self.vocab_size, self.tokenizer.vocab_size)
                self._sandbox = sandbox.Sandbox(self.tokenizer._backend.to_str(), n,
                                                list(self.tokenizer.eos_token_ids), self.timeout_s)
            return self._sandbox
