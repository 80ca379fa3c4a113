#!/usr/bin/env python3
"""By hand, not in CI: instructor, langchain-openai and litellm against an in-process server
(tests/entrypoints/live_app.py's LiveServer) over the embedded SmolLM2-135M (a real model, so the
constrained JSON ends within max_tokens; a random tiny model's strings never close). Prints one
RESULT line per call; docs/api.md's compatibility table records them.

  python -m venv --system-site-packages /tmp/clients && /tmp/clients/bin/pip install instructor langchain-openai litellm
  LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/clients/bin/python benchmarks/clients_by_hand.py
"""
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "entrypoints"), str(ROOT)]
from live_app import LiveServer  # noqa: E402
from specpipe.config import EngineConfig  # noqa: E402
from specpipe.engine.engine import Engine  # noqa: E402
from specpipe.entrypoints.openai.api_server import ServerOptions  # noqa: E402

from specpipe.loader.default_model import default_model_path  # noqa: E402
engine = Engine(EngineConfig(model=str(default_model_path()), mode="specpipe-db", draft="ngram", stages=2, transport="inproc",
                             kv_memory="64MiB", max_context=2048))
srv = LiveServer(engine, ServerOptions(), names=("smollm2",))
base = srv.url + "/v1"
results = {}

def trial(name, fn):
    try:
        results[name] = "pass: " + repr(fn())[:150]
    except Exception as e:
        traceback.print_exc()
        results[name] = f"FAIL: {type(e).__name__}: {str(e)[:300]}"

import openai  # noqa: E402
import pydantic  # noqa: E402
print("openai", openai.__version__)

class Person(pydantic.BaseModel):
    name: str
    age: int

def instructor_tools():
    import instructor
    c = instructor.from_openai(openai.OpenAI(base_url=base, api_key="x"), mode=instructor.Mode.TOOLS)
    return c.chat.completions.create(model="smollm2", response_model=Person, max_tokens=200, max_retries=0,
                                     messages=[{"role": "user", "content": "Alice is 30"}])

def instructor_json_schema():
    import instructor
    c = instructor.from_openai(openai.OpenAI(base_url=base, api_key="x"), mode=instructor.Mode.JSON_SCHEMA)
    return c.chat.completions.create(model="smollm2", response_model=Person, max_tokens=200, max_retries=0,
                                     messages=[{"role": "user", "content": "Alice is 30"}])

def lc_invoke():
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model="smollm2", base_url=base, api_key="x", max_tokens=8, temperature=0).invoke("hi").content

def lc_stream():
    from langchain_openai import ChatOpenAI
    return "".join(c.content for c in ChatOpenAI(model="smollm2", base_url=base, api_key="x", max_tokens=8).stream("hi"))

def lc_structured():
    from langchain_openai import ChatOpenAI
    m = ChatOpenAI(model="smollm2", base_url=base, api_key="x", max_tokens=200, temperature=0)
    return m.with_structured_output(Person).invoke("Alice is 30")

def lc_structured_fc():
    from langchain_openai import ChatOpenAI
    m = ChatOpenAI(model="smollm2", base_url=base, api_key="x", max_tokens=200, temperature=0)
    return m.with_structured_output(Person, method="function_calling").invoke("Alice is 30")

def lc_logprobs():
    from langchain_openai import ChatOpenAI
    m = ChatOpenAI(model="smollm2", base_url=base, api_key="x", max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    return m.invoke("hi").response_metadata["logprobs"]["content"][0]

def litellm_chat():
    import litellm
    r = litellm.completion(model="openai/smollm2", api_base=base, api_key="x", max_tokens=8,
                           messages=[{"role": "user", "content": "hi"}])
    return r.choices[0].message.content

def litellm_stream():
    import litellm
    r = litellm.completion(model="openai/smollm2", api_base=base, api_key="x", max_tokens=8, stream=True,
                           messages=[{"role": "user", "content": "hi"}])
    return "".join((c.choices[0].delta.content or "") for c in r)

def litellm_text():
    import litellm
    r = litellm.text_completion(model="text-completion-openai/smollm2", api_base=base, api_key="x", max_tokens=8, prompt="hi")
    return r.choices[0].text

def litellm_anthropic():
    import litellm
    r = litellm.completion(model="anthropic/smollm2", api_base=srv.url, api_key="x", max_tokens=8,
                           messages=[{"role": "user", "content": "hi"}])
    return r.choices[0].message.content

for name, fn in list(globals().items()):
    if callable(fn) and name.split("_")[0] in ("instructor", "lc", "litellm"):
        trial(name, fn)
for k, v in results.items():
    print(f"RESULT {k}: {v}")
srv.stop(); engine.close()
