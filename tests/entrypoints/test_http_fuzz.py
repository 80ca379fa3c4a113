"""HTTP fuzzing: schemathesis against the server's own OpenAPI schema, every route, valid and
invalid inputs (a short run; benchmarks/fuzz_http.py is the long one). No 5xx, every answer
(status, content type, body) within what the schema declares, and (issue 57) the engine alive
at the end: /health ok and an ordinary request served. The statuses seen are tallied by kind of
body (SPECPIPE_HTTP_FUZZ_REPORT: a JSON file to write the tally to)."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (after the skip)

from test_server_limits import KEYS, NAME, LiveServer, engine  # noqa: E402,F401  (engine: a fixture)
from specpipe.entrypoints.openai.api_server import ServerOptions  # noqa: E402

MAX_TOKENS = 4  # generated bodies may ask for the whole context: keep each answer quick
EXAMPLES = int(os.environ.get("SPECPIPE_HTTP_FUZZ_EXAMPLES", "4"))  # per route and phase; the long run sets more


@pytest.fixture(scope="module")
def fuzz_server(engine):  # noqa: F811
    s = LiveServer(engine, ServerOptions(api_keys=KEYS))  # the default body limit: bodies reach validation
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def steer(case, context: int, vocab: int) -> None:
    """In valid bodies: the served model's name, so that most reach the engine instead of a 404,
    and a small max_tokens that fits beside the prompt. The schema bounds a prompt of token ids
    and max_tokens each by the context, but their sum (also bounded) is beyond what JSON Schema
    can say. Output constraints and tools are taken out: whether a schema, regex or grammar
    compiles, or a tool_choice names one of the tools, is beyond JSON Schema too (their 400s are
    tests/entrypoints/test_structured_api.py's). So are /detokenize's ids within the model's
    vocabulary and top_logprobs only with logprobs: true (their 400s are test_api_surface.py's),
    and completions' best_of at least n (and equal to it when streamed).
    Invalid bodies are left as they are."""
    body = case.body
    if not isinstance(body, dict) or case.meta is None or case.meta.generation.mode.name != "POSITIVE":
        return
    prompt = body.get("prompt")
    ids = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else prompt
    room = context - len(ids) if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else MAX_TOKENS
    key = next((k for k in ("max_completion_tokens", "max_output_tokens") if k in body), "max_tokens")
    asked = body.get(key)
    body[key] = max(1, min(asked if isinstance(asked, int) and not isinstance(asked, bool) else MAX_TOKENS,
                           MAX_TOKENS, room))
    if isinstance(body.get("model"), str):
        body["model"] = NAME
    for field in ("guided_json", "guided_regex", "guided_grammar", "response_format", "tools", "tool_choice",
                  "output_config", "text"):  # /v1/messages' and /v1/responses' output constraints
        body.pop(field, None)
    if isinstance(body.get("tokens"), list):
        body["tokens"] = [int(t) % vocab if isinstance(t, (int, float)) and not isinstance(t, bool) else t
                          for t in body["tokens"]]  # integral floats (1e11) are JSON integers too
    if isinstance(body.get("logit_bias"), dict):  # token ids within the vocabulary (issue 62)
        body["logit_bias"] = {str(int(k) % vocab) if k.isdigit() else k: v for k, v in body["logit_bias"].items()}
    if body.get("top_logprobs") is not None and "messages" in body:
        body["logprobs"] = True
    n = body.get("n") if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) else 1
    if "prompt" in body and isinstance(body.get("best_of"), int) and not isinstance(body["best_of"], bool):
        # best_of at least n, and not over n when streamed (their 400s are test_best_of.py's)
        body["best_of"] = n if body.get("stream") is True else max(body["best_of"], n)


STATUSES: Counter = Counter()  # (valid|invalid body, status) -> answers


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_every_route_answers_within_its_schema(case, fuzz_server, engine):  # noqa: F811
    steer(case, engine.max_context, engine.prompts.vocab_size)
    kind = "valid" if case.meta is not None and case.meta.generation.mode.name == "POSITIVE" else "invalid"
    try:
        r = case.call_and_validate(headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60)
    except Exception:
        STATUSES[kind, "failed check"] += 1
        raise
    STATUSES[kind, r.status_code] += 1


def test_the_server_serves_after_the_fuzzing(fuzz_server):
    """Last in the file: nothing the fuzzing sent left the engine dead (issue 57: one bad value
    killed it, and every later request got a 503)."""
    tally = {f"{kind} {status}": n for (kind, status), n in sorted(STATUSES.items(), key=str)}
    print("statuses:", tally)
    if os.environ.get("SPECPIPE_HTTP_FUZZ_REPORT"):
        with open(os.environ["SPECPIPE_HTTP_FUZZ_REPORT"], "w") as f:
            json.dump({"examples_per_route_and_phase": EXAMPLES, "statuses": tally}, f, indent=1)
    assert not [k for k in STATUSES if k[1] in (500, 503)], tally
    assert fuzz_server.aengine.dead is None
    assert fuzz_server.get("/health").status_code == 200
    r = fuzz_server.post("/v1/completions", json={"model": NAME, "prompt": "the cat sat", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
