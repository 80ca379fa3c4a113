"""`specpipe bench serve`: load an OpenAI-compatible server with streamed requests and report
TTFT, TBT, ITL, end-to-end latency and throughput, at one or several request rates.

Any OpenAI-compatible server works (ours, vLLM, llama.cpp, ...). Requests arrive by a schedule
drawn up front (`arrival_offsets`): a Poisson process by default, burstier or more regular with
--burstiness, all at once with rate inf; --max-concurrency caps the requests in flight (with rate
inf that is a fixed-concurrency load). Each rate is one complete run over the same prompts; all
runs are reported together. Method: real run, the client's wall clock (see metrics.py for what
each figure means).

  specpipe bench serve --base-url http://127.0.0.1:8000 --num-prompts 60 --request-rate 1,4,inf
  python -m specpipe.bench.serve --dataset jsonl --dataset-path prompts.jsonl --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specpipe.bench import datasets
from specpipe.bench.metrics import (SLO_NAMES, RequestRecord, aggregate, format_markdown, format_rate,
                                    format_summary, rate_json)


class BenchError(Exception):
    """A condition that ends the benchmark with a one-line message (exit code 2)."""


@dataclass
class RequestInput:
    prompt: str
    max_tokens: int
    group: str | None = None
    leave_after: int | None = None  # the client disconnects after this many content chunks


@dataclass
class RequestSettings:
    """What every request of a run shares."""
    endpoint: str        # "completions" | "chat"
    model: str
    temperature: float
    timeout: float       # seconds for the whole request


# ---- command line ---------------------------------------------------------------------------

def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rates: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (inf allowed): {text!r}")
    return rates


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of percentiles: {text!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must lie in (0, 100]: {text!r}")
    return ps


def _slo(text: str) -> tuple[str, float]:
    key, _, value = text.partition(":")
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if key not in SLO_NAMES or not limit > 0:
        raise argparse.ArgumentTypeError(f"expected KEY:MILLISECONDS with KEY one of "
                                         f"{', '.join(SLO_NAMES)}, got {text!r}")
    return key, limit


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument
    p("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000; /v1 is appended)")
    p("--endpoint", choices=("completions", "chat"), default="completions",
      help="/v1/completions (default) or /v1/chat/completions")
    p("--model", default=None, help="model name to request (default: the first id of GET /v1/models)")
    p("--api-key", default=None, help="default: $OPENAI_API_KEY, else EMPTY")
    p("--dataset", choices=("specbench", "jsonl"), default="specbench",
      help="specbench: Spec-Bench's six groups round-robin (default); jsonl: one JSON object a line "
           'with "prompt" (or "text", or "turns") and an optional "max_tokens"')
    p("--dataset-path", default=None, help="the data file (specbench default: $SPECBENCH_FILE or shared/data/...)")
    p("--num-prompts", type=_positive(int), default=60, help="requests per rate (default 60)")
    p("--max-tokens", type=_positive(int), default=64, help="output tokens per request (default 64)")
    p("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p("--request-rate", type=_rates, default=[math.inf],
      help="requests/s, comma-separated for several runs, inf = all at once (default inf)")
    p("--burstiness", type=_positive(float), default=1.0,
      help="shape of the gamma-distributed gaps between arrivals: 1 = Poisson (default), <1 burstier, >1 more regular")
    p("--max-concurrency", type=_positive(int), default=None, help="at most this many requests in flight")
    p("--seed", type=int, default=0, help="prompt choice and arrival schedule (default 0)")
    p("--goodput", type=_slo, nargs="+", default=None, metavar="KEY:MS",
      help="SLOs in ms, e.g. ttft:500 tbt:100 e2el:10000; goodput counts requests meeting them all")
    p("--percentiles", type=_percentiles, default=[50.0, 90.0, 99.0], help="default 50,90,99")
    p("--result-json", default=None, metavar="FILE", help="write every figure and request here")
    p("--result-md", default=None, metavar="FILE", help="write the Markdown table here")
    p("--save-text", action="store_true", help="keep each request's generated text in the JSON")
    p("--label", default=None, help="a name stored with the results (e.g. the server's mode)")
    p("--no-progress", action="store_true", help="no progress bar")
    p("--timeout", type=_positive(float), default=600.0, help="seconds per request (default 600)")
    p("--disconnect-fraction", type=float, default=0.0,
      help="this share of the clients (chosen by --seed) close their stream after a random number of "
           "chunks, up to half of max_tokens, as clients that give up do (default 0)")


# ---- prompts and arrivals -------------------------------------------------------------------

def build_inputs(args: argparse.Namespace) -> list[RequestInput]:
    """`--num-prompts` requests from the data set; a JSONL file is taken in order, cycled if short;
    `--disconnect-fraction` of them leave early."""
    inputs = _inputs(args)
    fraction = getattr(args, "disconnect_fraction", 0.0)
    rng = random.Random(args.seed + 1)
    for inp in inputs:
        if rng.random() < fraction:
            inp.leave_after = rng.randint(1, max(1, inp.max_tokens // 2))
    return inputs


def _inputs(args: argparse.Namespace) -> list[RequestInput]:
    if args.dataset == "specbench":
        chosen = datasets.sample_specbench(args.num_prompts, seed=args.seed, path=args.dataset_path)
        return [RequestInput(p["prompt"], args.max_tokens, p["group"]) for p in chosen]
    if not args.dataset_path:
        raise BenchError("--dataset jsonl needs --dataset-path")
    rows = datasets.load_jsonl(args.dataset_path)
    if not rows:
        raise BenchError(f"no prompts in {args.dataset_path}")
    picked = (rows[i % len(rows)] for i in range(args.num_prompts))
    return [RequestInput(r["prompt"], r["max_tokens"] or args.max_tokens) for r in picked]


def arrival_offsets(rate: float, burstiness: float, n: int, seed: int) -> list[float]:
    """When each of n requests is sent, in seconds after the start. The gaps are gamma-distributed
    with shape `burstiness` and mean 1/rate (shape 1: exponential gaps, a Poisson process); the
    first request goes at 0. Rate inf sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # gamma's mean is shape * scale
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


# ---- requests -------------------------------------------------------------------------------

def _chunk_text(chunk, endpoint: str) -> str:
    if not chunk.choices:
        return ""
    if endpoint == "chat":
        return chunk.choices[0].delta.content or ""
    return chunk.choices[0].text or ""


async def _stream(client, s: RequestSettings, inp: RequestInput, rec: RequestRecord, start: float) -> None:
    common = dict(model=s.model, max_tokens=inp.max_tokens, temperature=s.temperature, stream=True,
                  stream_options={"include_usage": True}, timeout=s.timeout)
    if s.endpoint == "chat":
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": inp.prompt}], **common)
    else:
        stream = await client.completions.create(prompt=inp.prompt, **common)
    usage, pieces, last, last_choice = None, [], None, None
    async with stream:  # closes the connection also when the request times out
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage or usage
            if chunk.choices:
                last_choice = now
            text = _chunk_text(chunk, s.endpoint)
            if not text:
                continue
            if last is None:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last = now
            pieces.append(text)
            if inp.leave_after is not None and len(pieces) >= inp.leave_after:
                rec.disconnected = True  # leaving the block closes the connection
                return
    rec.e2el = time.perf_counter() - start
    rec.text = "".join(pieces)
    if usage is not None:
        rec.prompt_tokens, rec.output_tokens, rec.usage_reported = usage.prompt_tokens, usage.completion_tokens, True
    else:
        rec.output_tokens = len(pieces)
    if rec.ttft is None:
        # No text at all: a completion whose tokens are invisible (e.g. an immediate end of
        # sequence) still completed; its token came with the last choice (a chat stream's first
        # chunk may be a bare role), else with the stream's end.
        if last_choice is None and usage is None:
            raise BenchError("the stream held no completion")
        rec.ttft = last_choice - start if last_choice is not None else rec.e2el


async def send_request(client, s: RequestSettings, inp: RequestInput, index: int, t0: float) -> RequestRecord:
    """Send one streamed request and measure it; any failure is recorded, never raised."""
    rec = RequestRecord(index=index, group=inp.group)
    start = time.perf_counter()
    rec.send_time = start - t0
    try:
        await asyncio.wait_for(_stream(client, s, inp, rec, start), s.timeout)
        rec.success = True
    except asyncio.TimeoutError:
        rec.error = f"timed out after {s.timeout:g} s"
    except Exception as e:  # noqa: BLE001 -- a failed request must not end the run
        rec.error = f"{type(e).__name__}: {e}"[:500]
    return rec


async def run_rate(client, s: RequestSettings, inputs: list[RequestInput], offsets: list[float],
                   max_concurrency: int | None, progress: bool, desc: str) -> tuple[list[RequestRecord], float]:
    """One run: send inputs[i] at offsets[i] (later if max_concurrency requests are in flight).
    Returns the records in input order and the wall time from the start to the last answer."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(inputs), desc=desc, disable=not progress, unit="req")
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        async with limit:
            rec = await send_request(client, s, inputs[i], i, t0)
        bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(i) for i in range(len(inputs))))
    finally:
        bar.close()
    return list(records), time.perf_counter() - t0


# ---- the benchmark --------------------------------------------------------------------------

def _api_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def resolve_model(client, base_url: str, model: str | None) -> str:
    """Check that the server answers (GET /v1/models) and pick the model: `model`, else the first id."""
    import openai

    try:
        page = await client.with_options(timeout=30.0).models.list()
    except openai.APIConnectionError as e:
        raise BenchError(f"cannot reach an OpenAI-compatible server at {base_url} ({e.__cause__ or e})") from None
    except openai.APIStatusError as e:
        if model:
            return model  # some servers have no /v1/models; the requests will tell
        raise BenchError(f"GET /v1/models failed with HTTP {e.status_code}; pass --model") from None
    if model:
        return model
    ids = [m.id for m in page.data]
    if not ids:
        raise BenchError("the server lists no models; pass --model")
    return ids[0]


async def benchmark(args: argparse.Namespace, inputs: list[RequestInput] | None = None) -> dict:
    """Every rate of `args.request_rate` over the same prompts; prints a summary block per run and
    returns the results (the JSON written by --result-json). Raises BenchError."""
    import openai

    inputs = inputs if inputs is not None else build_inputs(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    slos = dict(args.goodput) if args.goodput else None
    async with openai.AsyncOpenAI(base_url=_api_url(args.base_url), api_key=api_key, max_retries=0,
                                  timeout=args.timeout) as client:
        model = await resolve_model(client, args.base_url, args.model)
        settings = RequestSettings(args.endpoint, model, args.temperature, args.timeout)
        runs = []
        for rate in args.request_rate:
            offsets = arrival_offsets(rate, args.burstiness, len(inputs), args.seed)
            desc = f"{args.label + ' ' if args.label else ''}rate {format_rate(rate)}"
            records, duration = await run_rate(client, settings, inputs, offsets, args.max_concurrency,
                                               not args.no_progress, desc)
            run = {"request_rate": rate_json(rate), "max_concurrency": args.max_concurrency,
                   "burstiness": args.burstiness, **aggregate(records, duration, args.percentiles, slos),
                   "requests": [r.to_json(args.save_text) for r in records]}
            print(format_summary(run, args.percentiles, args.label), flush=True)
            runs.append(run)
    return {"label": args.label, "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
            "dataset": args.dataset, "dataset_path": args.dataset_path, "num_prompts": len(inputs),
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "percentiles": args.percentiles, "goodput_slos_ms": slos,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "runs": runs}


def command_line() -> str:
    """This process's command line as a reader would retype it."""
    name = Path(sys.argv[0]).name
    prog = "python -m specpipe.bench.serve" if name == "serve.py" else shlex.quote(name)
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def write_outputs(results: dict | list[dict], markdown: str, json_path: str | None, md_path: str | None) -> None:
    for path, text in ((json_path, json.dumps(results, indent=1) + "\n"), (md_path, markdown)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when some request completed, 1 when none did, 2 on a setup error."""
    try:
        results = asyncio.run(benchmark(args))
    except (BenchError, FileNotFoundError, ValueError) as e:
        print(f"specpipe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    results["command"] = getattr(args, "command_line", None) or command_line()
    markdown = format_markdown([results], results["command"])
    print("\n" + markdown)
    write_outputs(results, markdown, args.result_json, args.result_md)
    return 0 if any(run["completed"] for run in results["runs"]) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m specpipe.bench.serve", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
