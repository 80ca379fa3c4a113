"""xgrammar against llguidance on our tokenizers: what choosing SpecPipe's grammar engine rests on.

For each vocabulary (the embedded SmolLM2-135M, and a Qwen2.5 GGUF when given) and each library:
the time to build its tokenizer view, to compile a JSON schema / a regex / an EBNF grammar and to
make a matcher for the schema, and
the time to fill one token mask along a fixed valid output (per token: mean, p50, max), plus
whether rollback works (accept 5 tokens, roll back 3, the mask equals the one taken then).

    PYTHONPATH=. python3 benchmarks/grammar_engines.py [--qwen PATH] [--out FILE]

xgrammar is not a SpecPipe dependency: `pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi` first
(without triton, which its masks on CPU do not need); without it only llguidance is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.common import cpu_name, resolve_model, write_json
from specpipe.tokenizer.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
}
OUTPUT = ('{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], '
          '"address": {"city": "London", "zip": "W1"}, "role": "admin"}')
REGEX = r"\d{3}-\d{4} [A-Z][a-z]+"
EBNF_GBNF = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9]+\n'
EBNF_LARK = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]+/\n'


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t0) * 1e3


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tok._backend)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size,
                                                       stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab = tok.vocab_size

    def compile(self, kind, spec):
        c = self.compiler
        return {"json": lambda: c.compile_json_schema(json.dumps(spec)), "regex": lambda: c.compile_regex(spec),
                "ebnf": lambda: c.compile_grammar(spec)}[kind]()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask)

    def accept(self, m, t):
        return m.accept_token(t)

    def rollback(self, m, n):
        m.rollback(n)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        import llguidance
        import llguidance.torch as lt

        self.ll, self.lt = llguidance, lt
        self.tok = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=tok.vocab_size,
                                          eos_token=list(tok.eos_token_ids))
        self.vocab = tok.vocab_size

    def compile(self, kind, spec):
        M = self.ll.LLMatcher
        g = {"json": lambda: M.grammar_from_json_schema(spec), "regex": lambda: M.grammar_from_regex(spec),
             "ebnf": lambda: M.grammar_from_lark(spec)}[kind]()
        err = M.validate_grammar(g, self.tok)
        if err:
            raise ValueError(err)
        return g

    def matcher(self, grammar):
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self):
        return self.lt.allocate_token_bitmask(1, self.vocab)

    def fill(self, m, mask):
        self.lt.fill_next_token_bitmask(m, mask, 0)

    def accept(self, m, t):
        return m.consume_token(t)

    def rollback(self, m, n):
        m.rollback(n)


def measure(engine_cls, tok: Tokenizer) -> dict:
    engine, build_ms = timed(engine_cls, tok)
    out = {"tokenizer_build_ms": round(build_ms, 1), "compile_ms": {}, "supports": {}}
    compiled = {}
    for kind, spec in (("json", SCHEMA), ("regex", REGEX), ("ebnf", EBNF_LARK if engine.name == "llguidance"
                                                            else EBNF_GBNF)):
        try:
            compiled[kind], ms = timed(engine.compile, kind, spec)
            out["compile_ms"][kind] = round(ms, 2)
            out["supports"][kind] = True
        except Exception as e:  # noqa: BLE001  (reported, not hidden)
            out["supports"][kind] = f"no: {e}"
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    m, ms = timed(engine.matcher, compiled["json"])
    out["matcher_ms"] = round(ms, 2)  # llguidance compiles lazily: its grammar is built here
    mask = engine.bitmask()
    times = []
    for t in ids:
        _, ms = timed(engine.fill, m, mask)
        times.append(ms * 1e3)
        allowed = bool((mask[0, t // 32] >> (t % 32)) & 1)
        if not allowed or not engine.accept(m, t):
            raise RuntimeError(f"{engine.name}: token {t} ({tok.decode([t])!r}) refused along a valid output")
    out["mask_us"] = {"tokens": len(times), "mean": round(statistics.mean(times), 1),
                      "p50": round(statistics.median(times), 1), "max": round(max(times), 1)}
    # rollback: the mask after rolling back must equal the mask taken at that point
    m = engine.matcher(compiled["json"])
    masks = []
    for t in ids[:5]:
        engine.fill(m, mask)
        masks.append(mask.clone())
        engine.accept(m, t)
    engine.rollback(m, 3)
    engine.fill(m, mask)
    out["supports"]["rollback"] = bool(torch.equal(mask, masks[2]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen", help="a Qwen2.5 GGUF, for its 151k vocabulary")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    models = {"smollm2-135m": resolve_model(None)}
    if a.qwen:
        models["qwen2.5"] = a.qwen
    result = {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "vocabularies": {}}
    for label, path in models.items():
        tok = Tokenizer.from_path(path)
        row = result["vocabularies"][label] = {"vocab_size": tok.vocab_size}
        for cls in (XGrammar, LLGuidance):
            try:
                row[cls.name] = measure(cls, tok)
            except ImportError as e:
                row[cls.name] = f"not installed: {e}"
            print(label, cls.name, json.dumps(row[cls.name]), flush=True)
    if a.out:
        write_json(a.out, result)


if __name__ == "__main__":
    main()
