"""The serving benchmark client: arrival schedule, aggregation, prompt files, and whole runs against
a tiny fake OpenAI-compatible server (in a thread here, in a subprocess for benchmarks/bench_serve.py).

No Spec-Bench data is needed: prompts come from temporary files.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn

from specpipe.bench import datasets, serve
from specpipe.bench.metrics import RequestRecord, aggregate, format_markdown, format_summary, percentile

REPO = Path(__file__).resolve().parents[2]
PIECES = ["Hel", "lo", " wor", "ld"]  # the fake server's content chunks
USAGE_TOKENS = 8                      # ... and the completion tokens its usage reports (2 a chunk)


# ---- the fake server ------------------------------------------------------------------------

def make_app(model: str = "fake-model", state: dict | None = None):
    """/health, /v1/models, /v1/completions and /v1/chat/completions, streaming PIECES with a small
    sleep each. A prompt containing FAIL gets HTTP 500; NOUSAGE: no usage chunk; EMPTY: one
    invisible token (no text, usage says 1 token); SILENT: nothing but [DONE]."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    state = state if state is not None else new_state()

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def events(body: dict, prompt: str, chat: bool):
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        head = {"id": "x-1", "created": 0, "model": model,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        try:
            if "SILENT" in prompt:
                yield "data: [DONE]\n\n"
                return
            for piece in ([] if "EMPTY" in prompt else PIECES) + [""]:
                await asyncio.sleep(0.01)
                finish = None if piece else "length"
                choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": finish} if chat else
                          {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None})
                yield sse({**head, "choices": [choice]})
            if (body.get("stream_options") or {}).get("include_usage") and "NOUSAGE" not in prompt:
                out = 1 if "EMPTY" in prompt else USAGE_TOKENS
                usage = {"prompt_tokens": 7, "completion_tokens": out, "total_tokens": 7 + out}
                yield sse({**head, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            state["in_flight"] -= 1

    async def generate(request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "code": 500}}, status_code=500)
        return StreamingResponse(events(body, prompt, chat), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                          "owned_by": "test"}]})

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])])


def new_state() -> dict:
    return {"in_flight": 0, "max_in_flight": 0, "bodies": []}


def run_fake_server(port: int, model: str) -> None:
    """Serve the fake app in this process until SIGINT (the subprocess that bench_serve starts)."""
    import uvicorn

    uvicorn.run(make_app(model), host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server():
    state = new_state()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(state=state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    server.should_exit = True
    thread.join(5)
    sock.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# ---- arrival schedule -----------------------------------------------------------------------

def test_rate_inf_sends_everything_at_once():
    assert serve.arrival_offsets(math.inf, 1.0, 5, seed=0) == [0.0] * 5


def test_schedule_is_deterministic_per_seed_and_starts_at_zero():
    a = serve.arrival_offsets(3.0, 1.0, 50, seed=7)
    assert a == serve.arrival_offsets(3.0, 1.0, 50, seed=7)
    assert a != serve.arrival_offsets(3.0, 1.0, 50, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))


def gaps(rate: float, burstiness: float, n: int = 20001) -> list[float]:
    offsets = serve.arrival_offsets(rate, burstiness, n, seed=1)
    return [b - a for a, b in zip(offsets, offsets[1:])]


@pytest.mark.parametrize("burstiness", [1.0, 4.0])
def test_mean_gap_is_one_over_rate(burstiness):
    assert statistics.fmean(gaps(4.0, burstiness)) == pytest.approx(0.25, rel=0.03)


def test_burstiness_sets_the_variance():
    # gamma gaps with shape k and mean m have variance m^2 / k: squared coefficient of variation 1/k
    cv2 = {k: statistics.pvariance(g) / statistics.fmean(g) ** 2 for k in (0.5, 1.0, 4.0) for g in [gaps(2.0, k)]}
    assert cv2[1.0] == pytest.approx(1.0, rel=0.1)
    assert cv2[4.0] == pytest.approx(0.25, rel=0.1)
    assert cv2[0.5] > 1.5


# ---- aggregation ----------------------------------------------------------------------------

def rec(index, ttft, e2el, out, success=True, **kw) -> RequestRecord:
    return RequestRecord(index=index, success=success, ttft=ttft, e2el=e2el, output_tokens=out, prompt_tokens=5,
                         usage_reported=True, itl=[(e2el - ttft) / max(out - 1, 1)] * (out - 1), **kw)


SYNTHETIC = [rec(0, 0.1, 1.0, 10), rec(1, 0.2, 2.0, 10), rec(2, 0.3, 0.5, 1), rec(3, 0.4, 4.0, 19),
             rec(4, 9.0, 9.0, 50, success=False, error="APIStatusError: 500")]


def test_aggregate_counts_throughput_and_percentiles():
    m = aggregate(SYNTHETIC, duration=2.0, percentiles=[50, 90, 99])
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["total_output_tokens"] == 40 and m["total_input_tokens"] == 20
    assert m["request_throughput"] == 2.0 and m["output_throughput"] == 20.0
    assert m["total_token_throughput"] == 30.0
    # the failed request (ttft 9 s) is in no latency statistic
    assert m["mean_ttft_ms"] == pytest.approx(250)
    assert (m["p50_ttft_ms"], m["p90_ttft_ms"], m["p99_ttft_ms"]) == pytest.approx((250, 370, 397))
    assert m["mean_e2el_ms"] == pytest.approx(1875)
    # TBT = (e2e - ttft) / (out - 1): 100, 200, 200 ms; the one-token request has none
    assert m["mean_tbt_ms"] == pytest.approx(500 / 3) and m["p50_tbt_ms"] == pytest.approx(200)
    assert m["mean_itl_ms"] == pytest.approx((9 * 100 + 9 * 200 + 18 * 200) / 36)
    assert m["errors"] == ["APIStatusError: 500"] and m["output_tokens_source"] == "usage"
    assert "request_goodput" not in m


@pytest.mark.parametrize("slos, good", [({"ttft": 250}, 2), ({"tbt": 150}, 2), ({"tpot": 150}, 2),
                                        ({"ttft": 250, "tbt": 150}, 1), ({"e2el": 1000}, 2),
                                        ({"ttft": 5, "e2el": 99999}, 0)])
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    m = aggregate(SYNTHETIC, duration=2.0, percentiles=[50], slos_ms=slos)
    assert m["goodput_requests"] == good and m["request_goodput"] == good / 2.0


def test_aggregate_with_no_success_and_chunk_counts():
    m = aggregate([SYNTHETIC[-1]], duration=1.0, percentiles=[50])
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["output_tokens_source"] is None
    mixed = [rec(0, 0.1, 1.0, 10), RequestRecord(index=1, success=True, ttft=0.1, e2el=0.2, output_tokens=3)]
    assert aggregate(mixed, 1.0, [50])["output_tokens_source"] == "mixed"


def test_percentile_matches_linear_interpolation():
    values = [random.Random(3).uniform(0, 100) for _ in range(37)]
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_formatting_one_row_per_run():
    run = {"request_rate": "inf", "max_concurrency": 4, "burstiness": 1.0,
           **aggregate(SYNTHETIC, 2.0, [50, 99], {"ttft": 250})}
    text = format_summary(run, [50, 99], label="pp-cb")
    assert "Successful requests:" in text and "P99 TTFT (ms):" in text and "Request goodput" in text
    md = format_markdown([{"label": "a", "percentiles": [50, 99], "runs": [run, {**run, "request_rate": 2.0}]}], "cmd x")
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert md.startswith("Command: `cmd x`") and len(table) == 4
    assert len({line.count("|") for line in table}) == 1 and "| a | 2 |" in table[3]


# ---- prompt files and options ---------------------------------------------------------------

def test_load_jsonl_reads_prompt_text_and_turns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"text": "b"}\n{"turns": ["c", "d"], "id": 1}\n')
    assert datasets.load_jsonl(path) == [{"prompt": "a", "max_tokens": 3}, {"prompt": "b", "max_tokens": None},
                                         {"prompt": "c", "max_tokens": None}]


@pytest.mark.parametrize("bad, message", [("{oops", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
                                          ('{"foo": "x"}', '"prompt"'), ('{"prompt": ""}', '"prompt"'),
                                          ('{"prompt": "x", "max_tokens": 0}', "max_tokens")])
def test_load_jsonl_names_the_bad_line(tmp_path, bad, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + bad + "\n")
    with pytest.raises(ValueError, match=rf"p\.jsonl:2: .*{message}"):
        datasets.load_jsonl(path)


def test_specbench_round_robin_and_missing_file(tmp_path, monkeypatch):
    questions = [{"question_id": lo + i, "turns": [f"q{lo + i}"]} for lo, _ in datasets.GROUPS.values() for i in range(2)]
    path = write_jsonl(tmp_path / "question.jsonl", questions)
    picked = datasets.sample_specbench(13, seed=1, path=path)
    assert [p["group"] for p in picked[:6]] == list(datasets.GROUPS) and len(picked) == 13
    assert picked == datasets.sample_specbench(13, seed=1, path=path)
    assert datasets.load_prompts(1, offset=1, path=path)[0] == {"group": "mt_bench", "question_id": 82, "text": "q82"}
    monkeypatch.delenv("SPECBENCH_FILE", raising=False)
    monkeypatch.setattr(datasets, "_REPO_ROOT", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="--dataset-path.*SPECBENCH_FILE"):
        datasets.data_file()


def test_option_parsing():
    args = parse(["--request-rate", "1, 2.5,inf", "--goodput", "ttft:500", "tbt:100", "--percentiles", "50,99.9"])
    assert args.request_rate == [1.0, 2.5, math.inf] and dict(args.goodput) == {"ttft": 500, "tbt": 100}
    assert args.percentiles == [50, 99.9] and args.endpoint == "completions" and args.max_concurrency is None
    for bad in (["--request-rate", "0"], ["--goodput", "ttft"], ["--goodput", "foo:3"], ["--percentiles", "0"]):
        with pytest.raises(SystemExit):
            parse(bad)


# ---- whole runs against the fake server -----------------------------------------------------

def test_end_to_end_two_rates(fake_server, tmp_path):
    url, state = fake_server
    state.update(new_state())
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "one"}, {"prompt": "two FAIL"}, {"text": "three"},
                                             {"prompt": "four NOUSAGE", "max_tokens": 3}, {"turns": ["five"]}])
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    args = parse(["--base-url", url, "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts", "5",
                  "--request-rate", "inf,100", "--goodput", "e2el:10000", "--result-json", str(out_json),
                  "--result-md", str(out_md), "--label", "fake", "--save-text", "--no-progress"])
    assert serve.main(args) == 0
    res = json.loads(out_json.read_text())
    assert (res["model"], res["label"], res["num_prompts"]) == ("fake-model", "fake", 5)
    assert [run["request_rate"] for run in res["runs"]] == ["inf", 100.0]
    for run in res["runs"]:
        assert (run["completed"], run["failed"], run["goodput_requests"]) == (4, 1, 4)
        assert "500" in run["errors"][0] and run["output_tokens_source"] == "mixed"
        assert run["total_output_tokens"] == 3 * USAGE_TOKENS + len(PIECES)
        assert run["p50_ttft_ms"] <= run["p50_e2el_ms"]
        for r in run["requests"]:
            if r["success"]:
                assert 0 < r["ttft_ms"] <= r["e2el_ms"] and len(r["itl_ms"]) == len(PIECES) - 1
                assert r["text"] == "".join(PIECES)
            else:
                assert r["index"] == 1 and r["ttft_ms"] is None
    assert {b["prompt"]: b["max_tokens"] for b in state["bodies"]} == {"one": 64, "two FAIL": 64, "three": 64,
                                                                       "four NOUSAGE": 3, "five": 64}
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in state["bodies"])
    md = out_md.read_text()
    assert "| fake | inf |" in md and "| fake | 100 |" in md and "Command: `" in md


def test_max_concurrency_and_chat(fake_server, tmp_path):
    url, state = fake_server
    state.update(new_state())
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    args = parse(["--base-url", url + "/v1", "--endpoint", "chat", "--model", "other", "--dataset", "jsonl",
                  "--dataset-path", str(data), "--num-prompts", "6", "--max-concurrency", "2", "--no-progress"])
    res = asyncio.run(serve.benchmark(args))
    assert res["model"] == "other" and res["runs"][0]["completed"] == 6
    assert 1 <= state["max_in_flight"] <= 2
    assert state["bodies"][0]["messages"] == [{"role": "user", "content": "p0"}]


def test_some_clients_disconnect_on_purpose(fake_server, tmp_path):
    """--disconnect-fraction: the chosen clients leave after a chunk or so; they are counted apart,
    not as failures, and the others complete."""
    url, state = fake_server
    state.update(new_state())
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    args = parse(["--base-url", url, "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts", "10",
                  "--max-tokens", "2", "--disconnect-fraction", "0.5", "--seed", "3", "--no-progress"])
    left = [i.leave_after is not None for i in serve.build_inputs(args)]
    assert 0 < sum(left) < 10 and all(i.leave_after in (None, 1) for i in serve.build_inputs(args))
    run = asyncio.run(serve.benchmark(args))["runs"][0]
    assert (run["disconnected"], run["completed"], run["failed"]) == (sum(left), 10 - sum(left), 0)
    assert [r["disconnected"] for r in run["requests"]] == left


def test_stream_without_text(fake_server, tmp_path):
    url, _ = fake_server
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "EMPTY"}, {"prompt": "SILENT"}])
    args = parse(["--base-url", url, "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts", "2",
                  "--no-progress"])
    empty, silent = asyncio.run(serve.benchmark(args))["runs"][0]["requests"]
    assert empty["success"] and empty["output_tokens"] == 1 and 0 < empty["ttft_ms"] <= empty["e2el_ms"]
    assert not silent["success"] and "no completion" in silent["error"]


def test_unreachable_server_is_one_line_and_exit_2(tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    args = parse(["--base-url", f"http://127.0.0.1:{closed_port()}", "--dataset", "jsonl",
                  "--dataset-path", str(data), "--no-progress"])
    assert serve.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specpipe: error: cannot reach") and "\n" not in err


# ---- benchmarks/bench_serve.py --------------------------------------------------------------

@pytest.fixture(scope="module")
def bench_serve():
    spec = importlib.util.spec_from_file_location("bench_serve", REPO / "benchmarks" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_serve_arguments(bench_serve):
    assert bench_serve.split_engine_args(["--modes", "pp", "--", "--stages", "2"]) == (["--modes", "pp"], ["--stages", "2"])
    assert bench_serve.split_engine_args(["--modes", "pp"]) == (["--modes", "pp"], [])
    cmd = bench_serve.server_command("pp-cb", 8123, ["--stages", "2"])
    assert cmd[-8:] == ["--mode", "pp-cb", "--host", "127.0.0.1", "--port", "8123", "--stages", "2"]
    with pytest.raises(ValueError, match="--port"):
        bench_serve.server_command("pp", 1, ["--port=9"])
    flags = ["--stages", "2", "--draft", "ngram", "--draft=x", "--tree-width", "4"]
    assert bench_serve.engine_args_for("pp-cb", flags) == ["--stages", "2", "--tree-width", "4"]
    assert bench_serve.engine_args_for("specpipe-db", flags) == flags


def test_bench_serve_stops_and_times_out(bench_serve, tmp_path):
    ignores_sigint = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                      "print('ready', flush=True); time.sleep(60)")
    stubborn = subprocess.Popen([sys.executable, "-c", ignores_sigint], stdout=subprocess.PIPE,
                                start_new_session=True, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    log = tmp_path / "log"
    log.write_text("loading...\n")
    with pytest.raises(bench_serve.ServerFailed, match="did not answer 200(.|\n)*loading"):
        bench_serve.wait_healthy(f"http://127.0.0.1:{closed_port()}", stubborn, 0.3, log)
    bench_serve.stop_server(stubborn, grace=0.3)
    assert stubborn.returncode == -signal.SIGKILL
    stubborn.stdout.close()


def test_bench_serve_modes_end_to_end(bench_serve, tmp_path, monkeypatch):
    seen = []

    def fake_command(mode, port, engine_args):
        seen.append(engine_args)
        if mode == "broken":
            return [sys.executable, "-c", "import sys; print('boom: no such mode', file=sys.stderr); sys.exit(3)"]
        code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}]; "
                f"import test_serve_bench as t; t.run_fake_server({port}, 'fake-{mode}')")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(bench_serve, "server_command", fake_command)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the servers' logs stay in tmp_path
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "serve.json"
    rc = bench_serve.main(["--modes", "m1,broken", "--dataset", "jsonl", "--dataset-path", str(data),
                           "--num-prompts", "2", "--request-rate", "inf,50", "--no-progress", "--startup-timeout", "30",
                           "--result-json", str(out), "--result-md", str(tmp_path / "serve.md"), "--", "--stages", "2"])
    assert rc == 1  # one mode failed
    combined = json.loads(out.read_text())
    assert combined["engine_args"] == ["--stages", "2"] and all(a == ["--stages", "2"] for a in seen)
    [res] = combined["results"]
    assert res["label"] == "m1" and res["model"] == "fake-m1" and len(res["runs"]) == 2
    assert all(run["completed"] == 2 for run in res["runs"])
    assert "boom: no such mode" in combined["failures"]["broken"]
    md = (tmp_path / "serve.md").read_text()
    assert "| m1 | inf |" in md and "| m1 | 50 |" in md
