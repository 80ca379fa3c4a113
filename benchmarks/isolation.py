"""Isolation: does one client's abuse pause another client's stream?

Starts `specpipe serve`, measures a victim's streamed completion alone (gaps between its chunks),
then again while one client keeps sending 8 MB bodies and another keeps sending requests with 200
stop strings (refused: at most 4) and streams with the most the server accepts (4 stop strings of
256 characters). Prints the victim's median, p99 and largest gap in both runs; the goal is a
largest gap under 2x the usual (median) gap of the run alone.

    python benchmarks/isolation.py --model TINY_LLAMA_DIR --stages 2 --max-tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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


async def big_bodies(url: str, stop: asyncio.Event, counts: dict) -> None:
    blob = json.dumps({"model": "m", "prompt": "x " * (4 << 20), "max_tokens": 4}).encode()  # 8 MB
    async with httpx.AsyncClient(timeout=300) as c:
        while not stop.is_set():
            try:
                r = await c.post(url + "/v1/completions", content=blob, headers={"content-type": "application/json"})
                counts[f"8MB body -> {r.status_code}"] = counts.get(f"8MB body -> {r.status_code}", 0) + 1
            except httpx.HTTPError as e:  # the server may close the connection on a 413
                counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1


async def stop_strings(url: str, stop: asyncio.Event, counts: dict) -> None:
    many = {"model": "m", "prompt": "hello", "max_tokens": 16, "stop": [f"s{i}" for i in range(200)]}
    most = {"model": "m", "prompt": "hello", "max_tokens": 64, "stream": True, "ignore_eos": True,
            "stop": [chr(0x4e00 + i) * 256 for i in range(4)]}
    async with httpx.AsyncClient(timeout=300) as c:
        while not stop.is_set():
            r = await c.post(url + "/v1/completions", json=many)
            counts[f"200 stops -> {r.status_code}"] = counts.get(f"200 stops -> {r.status_code}", 0) + 1
            async with c.stream("POST", url + "/v1/completions", json=most) as r:
                async for _ in r.aiter_lines():
                    pass
            counts[f"4x256 stops -> {r.status_code}"] = counts.get(f"4x256 stops -> {r.status_code}", 0) + 1


def summary(gaps: list[float]) -> str:
    q = sorted(gaps)
    return (f"{len(gaps)} gaps: median {statistics.median(q) * 1e3:.1f} ms, p99 {q[int(0.99 * (len(q) - 1))] * 1e3:.1f} ms, "
            f"max {q[-1] * 1e3:.1f} ms")


async def measure(url: str, max_tokens: int) -> tuple[list[float], list[float], dict]:
    alone = await victim(url, max_tokens)
    stop, counts = asyncio.Event(), {}
    noise = [asyncio.create_task(big_bodies(url, stop, counts)), asyncio.create_task(stop_strings(url, stop, counts))]
    await asyncio.sleep(1.0)  # the abuse is under way before the victim starts
    loaded = await victim(url, max_tokens)
    stop.set()
    await asyncio.gather(*noise)
    return alone, loaded, counts


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
    with served(args.model, args.stages, args.serve_args) as (_, url):
        alone, loaded, counts = asyncio.run(measure(url, args.max_tokens))
    usual = statistics.median(alone)
    print("alone:  " + summary(alone))
    print("abused: " + summary(loaded))
    print("abusers' requests: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"largest gap under abuse / usual gap alone: {max(loaded) / usual:.2f} (goal <= 2)")


if __name__ == "__main__":
    main()
