"""Grammar compilation is bounded (issue 57, finding 7): constraints that give up on what they
allow, or that take too long, are GrammarSpecErrors at compile time (a 400 before the request
is queued), in a child process whose time and memory the driver does not pay; the cache is
bounded; closing the compiler ends a compilation in progress at once."""

from __future__ import annotations

import os
import threading
import time

import pytest

from specpipe.grammar import GrammarSpecError, StructuredOutput
from specpipe.grammar import compiler as compiler_mod
from specpipe.grammar.compiler import GrammarCompiler
from specpipe.grammar.matcher import RequestGrammar


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from specpipe.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(tiny_llama_dir)


@pytest.fixture
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=5.0)
    yield c
    c.close()


def chained_gbnf(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "x{i}" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "end"\n'


def rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("spec", [
    StructuredOutput(regex="a{1000}{1000}"),  # llguidance: too many expressions at the first mask (3 s)
    StructuredOutput(grammar="start: " + " | ".join(f'"w{i}"' for i in range(3000))),  # a row over 2,000 items
], ids=["nested-repeat", "wide-lark"])
def test_a_grammar_that_gives_up_on_what_it_allows_is_refused_at_compile(compiler, spec):
    with pytest.raises(GrammarSpecError, match="cannot follow|longer than"):
        compiler.compile(spec)


def test_an_astral_character_compiles_and_is_followed(compiler, tokenizer):
    g = RequestGrammar(compiler.compile(StructuredOutput(regex="x𝄞y")))
    for t in tokenizer.encode("x𝄞y"):
        assert g.accept(t) is None
    assert g.complete


def test_a_slow_grammar_hits_the_deadline_and_the_next_one_compiles(compiler):
    compiler.compile(StructuredOutput(regex="[0-9]+"))  # the child is up: its start is not the grammar's time
    t0 = time.monotonic()
    with pytest.raises(GrammarSpecError, match="longer than 5 s"):
        compiler.compile(StructuredOutput(grammar=chained_gbnf(20_000)))  # minutes of GBNF conversion
    assert time.monotonic() - t0 < 8
    assert compiler.compile(StructuredOutput(regex="[a-z]+")) is not None


def test_the_driver_memory_stays_flat_over_many_bad_grammars(compiler):
    compiler.compile(StructuredOutput(regex="[0-9]+"))
    before = rss()
    for i in range(3):
        with pytest.raises(GrammarSpecError):
            compiler.compile(StructuredOutput(regex=f"a{{1000}}{{{1000 + i}}}"))
    assert rss() - before < 50 << 20, (before >> 20, rss() >> 20)  # in-process, one took 200 MB


def test_the_cache_holds_a_bounded_amount_of_grammar(compiler, monkeypatch):
    monkeypatch.setattr(compiler_mod, "CACHE_CHARS", 1)  # every entry is over it: only the newest stays
    first = compiler.compile(StructuredOutput(regex="[0-9]+"))
    compiler.compile(StructuredOutput(regex="[a-z]+"))
    assert len(compiler._cache) == 1
    assert compiler.compile(StructuredOutput(regex="[0-9]+")) is not first  # evicted: compiled again


def test_closing_ends_a_compilation_in_progress(compiler):
    compiler.compile(StructuredOutput(regex="[0-9]+"))
    errors = []

    def slow():
        try:
            compiler.compile(StructuredOutput(grammar=chained_gbnf(20_000)))
        except GrammarSpecError as e:
            errors.append(e)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    compiler.close()
    t.join(5)
    assert not t.is_alive() and errors and time.monotonic() - t0 < 2
