"""Structured output: constraints (StructuredOutput, a base type in sampling.py), their
compilation for a tokenizer (compiler.py; first in a child process under a deadline,
sandbox.py), a request's matcher that masks the target at every row
it sends (matcher.py), and the bitmask the last stage applies to the logits (bitmask.py). The engine is llguidance (benchmarks/grammar_engines.py,
docs/benchmarks.md §11)."""

from specpipe.sampling import GrammarSpecError, StructuredOutput

__all__ = ["GrammarSpecError", "StructuredOutput"]
