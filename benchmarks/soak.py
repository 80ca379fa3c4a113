"""Soak: `specpipe serve` under more load than it can take, for a while, with clients leaving.

Measures the server's capacity under steady arrivals: a first burst (32 requests at once) gives a
rough rate; then Poisson arrivals at --probe-load x that rate for --probe-seconds keep the server
saturated (its queue full, the excess refused with 429), and the requests it completed per second
there are its capacity. Then `specpipe bench serve` runs at --load x the capacity (Poisson
arrivals) for --minutes with --disconnect-fraction of the clients leaving early, sampling the
resident memory of the server and its stage processes and the server's steps. Verdicts: every
request completed, got 429 or a clean error (none lost); KV back to zero at the end; memory and
steps per second flat after warm-up.

    python benchmarks/soak.py --model TINY_LLAMA_DIR --stages 2 --minutes 20 --load 1.2
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

import httpx

from isolation import served
from specpipe.bench import serve as bench


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for t in Path(f"/proc/{p}/task").iterdir():
            children = Path(f"/proc/{p}/task/{t.name}/children")
            if children.exists():
                todo += [int(c) for c in children.read_text().split()]
    return out


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_bench(url: str, rate: float, n: int, max_tokens: int, disconnect: float, seed: int, more: str) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--base-url", url, "--num-prompts", str(n), "--max-tokens", str(max_tokens),
                              "--request-rate", str(rate), "--disconnect-fraction", str(disconnect),
                              "--seed", str(seed), "--no-progress", "--timeout", "300", *more.split()])
    return asyncio.run(bench.benchmark(args))["runs"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--load", type=float, default=1.2, help="times the measured capacity")
    ap.add_argument("--probe-load", type=float, default=3.0, help="times the burst rate, to saturate the server")
    ap.add_argument("--probe-seconds", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1)
    ap.add_argument("--serve-args", default="--max-queue 64")
    ap.add_argument("--bench-args", default="", help="more `specpipe bench serve` options (e.g. a JSONL data set)")
    args = ap.parse_args()
    with served(args.model, args.stages, args.serve_args) as (server, url):
        burst = run_bench(url, float("inf"), 32, args.max_tokens, 0.0, 0, args.bench_args)["request_throughput"]
        probe_rate = args.probe_load * burst
        probe = run_bench(url, probe_rate, max(1, int(probe_rate * args.probe_seconds)), args.max_tokens, 0.0, 2,
                          args.bench_args)
        cap = probe["completed"] / probe["duration_s"]
        rate = args.load * cap
        n = max(1, int(rate * args.minutes * 60))
        print(f"burst {burst:.2f} req/s; saturated at {probe_rate:.2f} req/s offered: {probe['completed']} completed "
              f"in {probe['duration_s']:.0f} s, {probe['failed']} refused or failed -> capacity {cap:.2f} req/s; "
              f"soak at {rate:.2f} req/s, {n} requests, {args.minutes:g} min", flush=True)
        samples, done = [], threading.Event()

        def sample() -> None:
            while not done.wait(10.0):
                pids = tree(server.pid)
                samples.append((time.monotonic(), sum(rss_mb(p) for p in pids), len(pids),
                                metric(url, "specpipe:pipeline_steps_total")))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        run = run_bench(url, rate, n, args.max_tokens, args.disconnect_fraction, 1, args.bench_args)
        done.set()
        sampler.join()
        time.sleep(2.0)
        kv = metric(url, "specpipe:kv_cache_blocks_in_use")
    errors = {}
    for r in run["requests"]:
        if r["error"]:
            key = r["error"][:60]
            errors[key] = errors.get(key, 0) + 1
    print(f"requests {n}: completed {run['completed']}, disconnected on purpose {run['disconnected']}, "
          f"failed {run['failed']} {errors or ''}")
    warm = samples[len(samples) // 5:]  # after the first fifth
    if len(warm) >= 2:
        rss = [s[1] for s in warm]
        rates = [(b[3] - a[3]) / (b[0] - a[0]) for a, b in zip(warm, warm[1:])]
        half = len(rates) // 2 or 1
        print(f"resident memory of the server + stages after warm-up: {min(rss):.0f}..{max(rss):.0f} MB "
              f"(first {rss[0]:.0f}, last {rss[-1]:.0f}; {warm[-1][2]} processes)")
        print(f"steps/s: first half {sum(rates[:half]) / half:.1f}, second half "
              f"{sum(rates[half:]) / max(1, len(rates) - half):.1f}")
    print(f"KV blocks in use at the end, all stages: {kv:.0f}")


if __name__ == "__main__":
    main()
