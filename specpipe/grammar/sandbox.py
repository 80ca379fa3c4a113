"""A constraint's first compilation, in a child process under a deadline.

Why a process: turning a constraint into llguidance's grammar can take time and memory out of
all proportion to its size (llguidance's GBNF converter is pure Python and quadratic: 2,000
chained rules 3.7 s, 20,000 about six minutes, holding the GIL all along; `a{1000}{1000}` builds
200 MB of lexer expressions), and a thread can be neither stopped nor bounded in memory. The
child does every step a request would meet first (convert, validate, build the matcher, then
probe it: compute the first masks and take a few of the tokens they allow, which is where
`a{1000}{1000}` and a Lark rule of 30,000 alternatives give up), and is killed when its deadline
passes, when its memory grows past a bound, or when the server stops. What it answers is the
checked grammar text, which the driver then builds its matcher from.

Protocol (JSON lines, nothing pickled): the parent writes the tokenizer once, then one
{"kind", "text"} per constraint; the child answers {"grammar": ...} or {"error": ...} for each.

This file runs as the child's script, so it imports nothing of specpipe (torch) at the top.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

# JSON as json.dumps writes it ('{"a": 1, "b": [2, 3]}'): no free whitespace, which small models
# otherwise fill with newlines until max_tokens. A schema's "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's resource limits, in the child and for the driver's matchers alike: its defaults,
# with fewer lexer states (each costs memory in every copy of the matcher).
LIMITS = dict(max_lexer_states=50_000, max_grammar_size=500_000, step_lexer_fuel=200_000,
              initial_lexer_fuel=1_000_000, max_items_in_row=2000)
PROBE_STEPS = 4  # masks computed along one path through the grammar ...
PROBE_TOKENS = 16  # ... and at each, this many of the tokens they allow taken (and rolled back)
MAX_CHILD_RSS = 1 << 30  # a child past this after a compilation is replaced


def limits():
    import llguidance

    return llguidance.LLParserLimits(**LIMITS)


def grammar_text(kind: str, text: str) -> str:
    """A constraint as llguidance grammar text (not yet checked); ValueError when it is none."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    M = llguidance.LLMatcher
    if kind == "json_schema":
        return M.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return M.grammar_from_regex(text)
    return M.grammar_from_lark(any_to_lark(text))  # Lark as is; GBNF converted


def probe(matcher, n_vocab: int) -> Optional[str]:
    """Why the matcher gives up on what its own masks allow (None: it does not, on this walk).
    Along one path (the first allowed token each time), the first and last allowed tokens and
    some spread between them are each taken and rolled back."""
    taken = 0
    try:
        for _ in range(PROBE_STEPS):
            if matcher.is_error() or matcher.is_stopped():
                break
            mask = matcher.compute_bitmask()
            allowed = [t for t in range(min(n_vocab, 8 * len(mask))) if mask[t >> 3] >> (t & 7) & 1]
            if matcher.is_error() or not allowed:
                break
            step = max(1, len(allowed) // PROBE_TOKENS)
            for t in dict.fromkeys([*allowed[::step][:PROBE_TOKENS - 1], allowed[-1]]):
                if not matcher.consume_token(t):
                    return matcher.get_error() or f"token {t} is allowed and then refused"
                matcher.rollback(1)
            matcher.consume_token(allowed[0])
            taken += 1
        return matcher.get_error() if matcher.is_error() else None
    finally:
        if taken and not matcher.is_error():
            matcher.rollback(taken)


def check(tokenizer, n_vocab: int, kind: str, text: str) -> dict:
    import llguidance

    try:
        grammar = grammar_text(kind, text)
    except Exception as e:  # noqa: BLE001  (the converters raise ValueError and their own errors)
        return {"error": str(e)}
    err = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits())
    if err:
        return {"error": err.strip()}
    m = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    why = m.get_error() if m.is_error() else probe(m, n_vocab)
    if why:
        return {"error": f"the grammar cannot follow what it allows: {why.strip().splitlines()[0]}"}
    return {"grammar": grammar}


def child_main() -> None:
    try:  # die with the parent, even in the middle of a compilation (Linux)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import llguidance

    head = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(head["tokenizer"], n_vocab=head["n_vocab"], eos_token=head["eos"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(check(tokenizer, head["n_vocab"], req["kind"], req["text"])), flush=True)


class SandboxError(ValueError):
    """The constraint was refused (its text says why: llguidance's error, or a limit passed)."""


class Sandbox:
    """The parent's end: one child at a time, started when first needed (about a second to build
    llguidance's view of the vocabulary) and again after it was killed."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int], timeout_s: float) -> None:
        self._head = json.dumps({"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": eos}) + "\n"
        self.timeout_s = timeout_s
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._closed = False

    def check(self, kind: str, text: str) -> str:
        """llguidance's grammar text for the constraint; SandboxError when refused or over time."""
        deadline = time.monotonic() + self.timeout_s
        if not self._lock.acquire(timeout=self.timeout_s):
            raise SandboxError(f"the grammar compiler stayed busy for {self.timeout_s:g} s; try again")
        try:
            if self._closed:
                raise SandboxError("the server is shutting down")
            if self._proc is None:
                self._start(deadline + 30.0)  # building the vocabulary is not the constraint's time
                deadline = time.monotonic() + self.timeout_s
            self._proc.stdin.write((json.dumps({"kind": kind, "text": text}) + "\n").encode())
            self._proc.stdin.flush()
            answer = self._read(deadline)
            if answer is None:
                self._kill()
                raise SandboxError(f"compiling it took longer than {self.timeout_s:g} s (the limit)")
            if _rss(self._proc.pid) > MAX_CHILD_RSS:
                self._kill()  # its memory is not given back: start a fresh one next time
            if "error" in answer:
                raise SandboxError(answer["error"])
            return answer["grammar"]
        except (OSError, ValueError) as e:
            if isinstance(e, SandboxError):
                raise
            self._kill()
            raise SandboxError(f"the grammar compiler failed: {e}") from None
        finally:
            self._lock.release()

    def close(self) -> None:
        """Kill the child (a compilation in progress ends with an error); refuse from now on."""
        self._closed = True
        self._kill()

    def _start(self, deadline: float) -> None:
        self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._proc.stdin.write(self._head.encode())
        self._proc.stdin.flush()
        if self._read(deadline) != {"ready": True}:
            self._kill()
            raise SandboxError("the grammar compiler did not start")

    def _read(self, deadline: float) -> Optional[dict]:
        """The child's next answer; None at the deadline. EOF (killed) is an error."""
        proc, buf = self._proc, b""
        if proc is None:
            raise OSError("the grammar compiler was stopped")
        fd = proc.stdout.fileno()
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise OSError("the grammar compiler stopped")
            buf += chunk
        return json.loads(buf)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


if __name__ == "__main__":
    child_main()
