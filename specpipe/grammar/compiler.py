"""Constraints compiled for one tokenizer, with llguidance, and cached.

Building llguidance's view of a vocabulary takes about a second (once per tokenizer and process);
turning a constraint into a checked grammar takes under a millisecond and is cached by the
constraint (an LRU of `CACHE_SIZE`), so a server that sees the same schema again compiles it once.
A constraint that does not compile is a `GrammarSpecError` with llguidance's message.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from specpipe.sampling import GrammarSpecError, StructuredOutput
from specpipe.tokenizer.tokenizer import Tokenizer

CACHE_SIZE = 256
# JSON as json.dumps writes it ('{"a": 1, "b": [2, 3]}'): no free whitespace, which small models
# otherwise fill with newlines until max_tokens. A schema's "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_flexible": False}


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
                m = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
                if m.is_error():
                    raise GrammarSpecError(f"{self.spec.kind}: {m.get_error()}")
                self._prototype.append(m)
            return self._prototype[0].deep_copy()


def grammar_text(spec: StructuredOutput) -> str:
    """The constraint as llguidance grammar text (not yet checked)."""
    M = llguidance.LLMatcher
    try:
        if spec.json_schema is not None:
            return M.grammar_from_json_schema(spec.json_schema, defaults=JSON_OPTIONS)
        if spec.json_object:
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return M.grammar_from_regex(spec.regex)
        return M.grammar_from_lark(any_to_lark(spec.grammar))  # Lark as is; GBNF converted
    except Exception as e:  # noqa: BLE001  (llguidance's converters raise ValueError and their own errors)
        raise GrammarSpecError(f"{spec.kind}: {e}") from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer and a model whose logits are `vocab_size` wide."""

    _tokenizers: dict[tuple[str, int], llguidance.LLTokenizer] = {}
    _tokenizers_lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None

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
        """The checked grammar for `spec` (cached); GrammarSpecError when it does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        ll = self.ll_tokenizer()
        text = grammar_text(spec)
        err = llguidance.LLMatcher.validate_grammar(text, ll)
        if err:
            raise GrammarSpecError(f"{spec.kind}: {err.strip()}")
        compiled = CompiledGrammar(spec, text, ll, self.vocab_size)
        compiled.matcher()  # builds the lexer: an error that only shows there is raised now, not mid-request
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
