"""Every code block of the README and the user guide runs as printed, and does what it says.

A fenced block tagged `bash` or `python` runs: shell blocks under `bash -eo pipefail`, Python
blocks as scripts, each page's blocks in order in one scratch directory of the page's own (so a
later block finds what an earlier one wrote: measuring.md's traces). Blocks without a tag are
pictures (a step, the package's layout) and do not run. A block preceded by
`<!-- not-run: REASON -->` does not run either; REASON must be one of NOT_RUN_REASONS (it needs a
cluster, a model we do not have, installs the package, or takes minutes), so a block is never
skipped quietly.

The server: a block whose command is `specpipe serve ...` is the one the README prints; the
module starts it once (with port 8000 replaced by a free port, in that block and in every block
that talks to it) and every block that names 127.0.0.1:8000 runs against it. Each runnable block
has an entry in CHECKS: what its output must show (a haiku is not empty, a tool call is a tool
call), and test_every_runnable_block_is_checked fails on a new block without one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/generating.md", "docs/serving.md", "docs/structured.md", "docs/cluster.md",
         "docs/models.md", "docs/measuring.md", "docs/architecture.md"]
NOT_RUN_REASONS = ("needs a cluster", "needs a large model", "installs the package", "set-up", "takes minutes")
RUNS = {"bash", "python"}
PORT = "8000"


def blocks(page: str) -> list[dict]:
    """Every fenced block of `page`: its language, text, first line and the not-run reason before it."""
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = re.match(r"^<!-- not-run: (.*) -->$", before.strip())
        out.append({"page": page, "line": i + 1, "lang": m.group(1), "text": "\n".join(lines[i + 1:end]) + "\n",
                    "not_run": skip.group(1) if skip else None})
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b["lang"] in RUNS and b["not_run"] is None]


def is_server(block: dict) -> bool:
    return block["lang"] == "bash" and block["text"].lstrip().startswith("specpipe serve ")


def needs_server(block: dict) -> bool:
    return f"127.0.0.1:{PORT}" in block["text"]


def key(block: dict) -> str:
    return f"{block['page']}:{block['text'].strip().splitlines()[0]}"


def check_for(block: dict):
    """The CHECKS entry whose key starts the block's page and first line (None: no check)."""
    found = [k for k in CHECKS if key(block).startswith(k)]
    assert len(found) <= 1, found
    return CHECKS[found[0]] if found else None


def _json_objects(text: str) -> list:
    """Concatenated JSON documents (curl prints one body after another)."""
    out, dec, i = [], json.JSONDecoder(), 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
    return out


def check_first_command(out, cwd):
    assert "Paris" in out


def check_two_stages(out, cwd):
    d = json.loads(out.strip().splitlines()[-1])
    assert d["stats"]["num_stages"] == 2 and d["stats"]["mode"] == "specpipe" and d["stats"]["draft"] == "ngram"
    assert d["stats"]["tokens_per_step"] > 0 and d["stats"]["hit_rate"] is not None and d["text"].strip()


def check_curl_hello(out, cwd):
    (d,) = _json_objects(out)
    assert d["choices"][0]["message"]["content"].strip()


def check_openai_chat(out, cwd):
    assert "Paris" in out


def check_python_api(out, cwd):
    # print(out.text, out.finish_reason, tokens_per_step): an empty haiku would start the line with its reason
    assert not re.match(r"\s*(stop|length) ", out), f"the haiku is empty: {out!r}"
    first = re.search(r"(?s)^(.*?) (stop|length) ([0-9.]+)\n", out)
    assert first and len(first.group(1).split()) >= 3, out
    assert out[first.end():].strip(), "the chat answer is empty"


def check_stream(out, cwd):
    assert "Paris" in out


def check_bench_serve(out, cwd):
    result = json.loads((cwd / "out.json").read_text())
    text = json.dumps(result)
    assert '"completed": 4' in text or '"completed":4' in text, text[:500]


def check_structured_curl(out, cwd):
    person, obj, regex, grammar, tool = _json_objects(out)
    p = json.loads(person["choices"][0]["message"]["content"])
    assert set(p) == {"name", "age"} and isinstance(p["age"], int) and len(p["name"]) <= 20
    assert obj["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)
    assert regex["choices"][0]["finish_reason"] == grammar["choices"][0]["finish_reason"] == "stop"
    assert re.fullmatch(r"(Monday|Friday), [0-9]{1,2} (May|June) 20[0-9]{2}", regex["choices"][0]["text"])
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\) = [1-9][0-9]?", grammar["choices"][0]["text"])
    call = tool["choices"][0]["message"]["tool_calls"][0]["function"]
    assert tool["choices"][0]["finish_reason"] == "tool_calls" and call["name"] == "get_weather"
    assert set(json.loads(call["arguments"])) == {"city"}


def check_structured_python(out, cwd):
    lines = out.strip().splitlines()
    p = json.loads(lines[0])
    assert set(p) == {"name", "age"}
    assert isinstance(json.loads(lines[1]), dict)
    assert re.fullmatch(r"(Monday|Friday), [0-9]{1,2} (May|June) 20[0-9]{2}", lines[2])
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\) = [1-9][0-9]?", lines[3])
    name, arguments = lines[4].split(" ", 1)
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
    assert "get_weather" in lines[5] and "city" in lines[5], lines[5]


def check_bench(out, cwd):
    runs = json.loads((cwd / "r.json").read_text())
    assert "specpipe" in json.dumps(runs) and (cwd / "r.md").is_file()
    assert len(list((cwd / "traces").glob("*.json"))) == 2 and list((cwd / "oracle-traces").glob("*.json"))


def check_profile_sim(out, cwd):
    assert (cwd / "small-profile.json").is_file()
    assert len(re.findall(r"trace_\S+\s+(pp|specpipe)\s+2\s", out)) == 4, out


CHECKS = {
    "README.md:specpipe generate \"Name the capital of France.\"": check_first_command,
    "README.md:specpipe generate --stages 2 --mode specpipe --draft ngram --max-tokens 32 --json \"Coun": check_two_stages,
    "README.md:curl http://127.0.0.1:8000/v1/chat/completions -H \"Content-Type: application/json\" ": check_curl_hello,
    "README.md:from openai import OpenAI": check_openai_chat,
    "README.md:from specpipe import LLM, SamplingParams": check_python_api,
    "docs/serving.md:curl http://127.0.0.1:8000/v1/chat/completions -H \"Content-Type: application/json\" ": check_curl_hello,
    "docs/serving.md:from openai import OpenAI": check_stream,
    "docs/serving.md:echo '{\"prompt\": \"Count from 1 to 20.\"}' > prompts.jsonl": check_bench_serve,
    "docs/structured.md:curl http://127.0.0.1:8000/v1/chat/completions -H \"Content-Type: application/json\" ": check_structured_curl,
    "docs/structured.md:from openai import OpenAI": check_structured_python,
    "docs/measuring.md:echo '{\"prompt\": \"Count from 1 to 20.\"}' > prompts.jsonl": check_bench,
    "docs/measuring.md:specpipe profile --threads 1 --rows 1,8 --contexts 256 --repeats 1 --idle-gaps none --out ": check_profile_sim,
}


def test_not_run_blocks_say_why():
    for b in ALL:
        if b["not_run"] is not None:
            assert b["not_run"].startswith(NOT_RUN_REASONS), f"{b['page']}:{b['line']}: {b['not_run']!r}"
    assert any(b["not_run"] for b in ALL) and len(RUNNABLE) >= 10


def test_every_runnable_block_is_checked():
    for b in RUNNABLE:
        assert is_server(b) or check_for(b), f"{b['page']}:{b['line']} has no check: add one for {key(b)!r}"
    stale = [k for k in CHECKS if not any(key(b).startswith(k) for b in RUNNABLE)]
    assert not stale, f"checks for blocks that are gone: {stale}"


def test_setup_commands_are_what_ci_runs():
    """The README's set-up block is .ci/run's two commands, word for word."""
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() in ("./install.sh", "python3 -m pytest -q")]
    setup = next(b for b in blocks("README.md") if (b["not_run"] or "").startswith("set-up"))
    commands = [line.split("#")[0].strip() for line in setup["text"].splitlines() if line.strip()]
    assert ci == ["./install.sh", "python3 -m pytest -q"] and commands == ci


@pytest.fixture(scope="module")
def default_model():
    from specpipe.loader.default_model import DefaultModelMissing, default_model_path

    try:
        return default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(port, default_model, tmp_path_factory):
    """The README's `specpipe serve` block, running, on a free port."""
    (b,) = [b for b in ALL if b["page"] == "README.md" and is_server(b)]
    log = tmp_path_factory.mktemp("server") / "log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "-c", "exec " + b["text"].strip().replace(f"--port {PORT}", f"--port {port}")],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield b["text"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    return {page: tmp_path_factory.mktemp(Path(page).stem) for page in PAGES}


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"{b['page']}:{b['line']}")
def test_block_runs_as_printed(block, request, default_model, port, workdirs):
    if is_server(block):
        assert block["text"] == request.getfixturevalue("server"), "every page serves what the README serves"
        return
    text = block["text"]
    if needs_server(block):
        request.getfixturevalue("server")
        text = text.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}")
    if re.search(r"^curl ", text, re.M) and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    argv = ["bash", "-eo", "pipefail", "-c", text] if block["lang"] == "bash" else [sys.executable, "-c", text]
    cwd = workdirs[block["page"]]
    p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{block['page']}:{block['line']} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    check_for(block)(p.stdout, cwd)
