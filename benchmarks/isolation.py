"""Isolation: does one client's abuse pause another client's stream?

Starts `specpipe serve` and measures a victim's streamed completion (gaps between its chunks)
three times: alone; beside one ordinary stream (with the most stop strings the server accepts,
4 of 256 characters: sharing the engine's steps, not abuse); and under abuse: that stream plus one
client that keeps sending 8 MB bodies and one that keeps sending requests with 200 stop strings
(refused: at most 4). The other clients run in a process of their own at the lowest CPU priority,
standing in for clients on other machines: on a small machine their own sending would otherwise
take the server's cores, which no server can prevent. Prints the victim's median, p99 and largest
gap in each run; the goal is a largest gap under abuse within 2x the usual (median) gap alone.

    python benchmarks/isolation.py --model TINY_LLAMA_DIR --stages 2 --max-tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def victim(url: str, max_tokens: int) -> list[float]:
    """Gaps (s) between the stream's chunks."""
    body = {"model": "m", "prompt": "the cat sat on the mat and", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    async with httpx.AsyncClient(timeout=300) as c:
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def big_bodies(url: str, stop, counts: dict) -> None:
    blob = json.dumps({"model": "m", "prompt": "x " * (4 << 20), "max_tokens": 4}).encode()  # 8 MB
    async with httpx.AsyncClient(timeout=300) as c:
        while not stop.is_set():
            try:
                r = await c.post(url + "/v1/completions", content=blob, headers={"content-type": "application/json"})
                counts[f"8MB body -> {r.status_code}"] = counts.get(f"8MB body -> {r.status_code}", 0) + 1
            except httpx.HTTPError as e:  # the server may close the connection on a 413
                counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1


async def many_stops(url: str, stop, counts: dict) -> None:
    many = {"model": "m", "prompt": "hello", "max_tokens": 16, "stop": [f"s{i}" for i in range(200)]}
    async with httpx.AsyncClient(timeout=300) as c:
        while not stop.is_set():
            r = await c.post(url + "/v1/completions", json=many)
            counts[f"200 stops -> {r.status_code}"] = counts.get(f"200 stops -> {r.status_code}", 0) + 1


async def long_stops_stream(url: str, stop, counts: dict) -> None:
    most = {"model": "m", "prompt": "hello", "max_tokens": 64, "stream": True, "ignore_eos": True,
            "stop": [chr(0x4e00 + i) * 256 for i in range(4)]}
    async with httpx.AsyncClient(timeout=300) as c:
        while not stop.is_set():
            async with c.stream("POST", url + "/v1/completions", json=most) as r:
                async for _ in r.aiter_lines():
                    pass
            counts[f"4x256 stops -> {r.status_code}"] = counts.get(f"4x256 stops -> {r.status_code}", 0) + 1


CLIENTS = {"big": big_bodies, "stops": many_stops, "stream": long_stops_stream}


def other_clients(url: str, kinds: list[str], stop, out) -> None:
    """The other clients, in a process of their own at the lowest priority, until `stop` is set."""
    os.nice(19)

    async def run() -> dict:
        counts: dict = {}
        await asyncio.gather(*(CLIENTS[k](url, stop, counts) for k in kinds))
        return counts

    out.put(asyncio.run(run()))


def summary(gaps: list[float]) -> str:
    q = sorted(gaps)
    return (f"{len(gaps)} gaps: median {statistics.median(q) * 1e3:.1f} ms, p99 {q[int(0.99 * (len(q) - 1))] * 1e3:.1f} ms, "
            f"max {q[-1] * 1e3:.1f} ms")


def measure(url: str, max_tokens: int, kinds: list[str]) -> tuple[list[float], dict]:
    """The victim's gaps while the `kinds` of other clients run (none: alone)."""
    if not kinds:
        return asyncio.run(victim(url, max_tokens)), {}
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    others = ctx.Process(target=other_clients, args=(url, kinds, stop, out))
    others.start()
    time.sleep(2.0)  # the others are under way before the victim starts
    gaps = asyncio.run(victim(url, max_tokens))
    stop.set()
    counts = out.get(timeout=300)
    others.join(30)
    return gaps, counts


@contextlib.contextmanager
def served(model: str, stages: int, serve_args: str = ""):
    """`specpipe serve` in a child process, model name "m", until the block ends: (process, url)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specpipe.entrypoints.cli", "serve", "--model", model, "--stages",
           str(stages), "--port", str(port), "--served-model-name", "m", "--log-level", "warning",
           *serve_args.split()]
    server = subprocess.Popen(cmd, env=os.environ.copy())
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        yield server, url
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--serve-args", default="", help="more `specpipe serve` options, one string")
    args = ap.parse_args()
    runs = {}
    with served(args.model, args.stages, args.serve_args) as (_, url):
        for label, kinds in (("alone", []), ("shared", ["stream"]), ("abused", ["stream", "big", "stops"])):
            runs[label] = measure(url, args.max_tokens, kinds)
    usual = statistics.median(runs["alone"][0])
    for label, (gaps, counts) in runs.items():
        print(f"{label + ':':8}" + summary(gaps) + (" | others: " + ", ".join(f"{k}: {v}" for k, v in
                                                                               sorted(counts.items())) if counts else ""))
    print(f"largest gap / usual gap alone: shared {max(runs['shared'][0]) / usual:.2f}, "
          f"abused {max(runs['abused'][0]) / usual:.2f} (goal <= 2)")

if __name__ == "__main__":
    main()
