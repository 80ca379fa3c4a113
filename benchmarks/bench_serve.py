#!/usr/bin/env python3
"""The serving benchmark (`specpipe bench serve`) behind our own server, for several modes in one
run (method: real run, this machine, the client's wall clock).

For each mode of --modes: start `specpipe serve --mode MODE --port PORT` plus the engine flags
given after `--`, wait until GET /health answers 200, run the benchmark at every --request-rate
over the same prompts, stop the server (SIGINT, then after 30 s SIGKILL); finally write one JSON
with every mode's results and print one Markdown table, a row per mode and rate.

--draft is dropped for the modes that do not speculate (pp, pp-cb), so one set of engine flags
serves every mode. Every option of `specpipe bench serve` applies (prompts, rates, concurrency, SLOs, ...), except
--base-url and --label, which are set per server. A mode whose server fails to start is reported
(with the tail of its log) and the others still run; the exit code is then 1.

Usage:
  python benchmarks/bench_serve.py [--modes pp-cb,specpipe-db] [--num-prompts 60]
      [--request-rate 1,2,inf] [--max-concurrency N] [--result-json FILE] [--result-md FILE]
      -- --stages 2 --draft ngram [other `specpipe serve` engine flags]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specpipe.bench import serve  # noqa: E402
from specpipe.bench.metrics import format_markdown  # noqa: E402
from specpipe.config import SPECULATIVE_MODES  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "serve_s2.json"
HOST = "127.0.0.1"
RESERVED = ("--mode", "--port", "--host")  # set here per server, not in the engine flags


class ServerFailed(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                usage="%(prog)s [options] -- [specpipe serve engine flags]")
    serve.add_arguments(p)
    p.add_argument("--modes", default="pp-cb,specpipe-db", help="comma-separated (default pp-cb,specpipe-db)")
    p.add_argument("--port", type=int, default=0, help="the servers' port (default: a free one)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for a server to answer /health (default 600)")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds after SIGINT before SIGKILL (default 30)")
    p.set_defaults(result_json=str(DEFAULT_JSON))
    return p


def split_engine_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's arguments, the engine flags after the first `--`)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def engine_args_for(mode: str, engine_args: list[str]) -> list[str]:
    """The engine flags for one mode: without --draft in a mode that does not speculate (the server
    refuses it there), so that one set of flags serves every mode of the run."""
    if mode in SPECULATIVE_MODES:
        return list(engine_args)
    out, skip = [], False
    for a in engine_args:
        if skip:
            skip = False
        elif a == "--draft":
            skip = True
        elif not a.startswith("--draft="):
            out.append(a)
    return out


def server_command(mode: str, port: int, engine_args: list[str]) -> list[str]:
    clash = [a for a in engine_args if a.split("=")[0] in RESERVED]
    if clash:
        raise ValueError(f"{', '.join(clash)}: set by this script, not after `--`")
    return [sys.executable, "-m", "specpipe.entrypoints.cli", "serve", "--mode", mode,
            "--host", HOST, "--port", str(port), *engine_args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log_tail(path: str | Path, lines: int = 30) -> str:
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join("  | " + line for line in text[-lines:])


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float, log_path: str | Path) -> None:
    """Poll GET /health until 200; ServerFailed if the process exits first or time runs out."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerFailed(f"the server exited with code {proc.returncode} before it was healthy; "
                               f"its log ends:\n{log_tail(log_path)}")
        try:
            with opener.open(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or not healthy yet (an HTTPError is a URLError)
        if time.monotonic() > deadline:
            raise ServerFailed(f"{base_url}/health did not answer 200 within {timeout:g} s; "
                               f"the log ends:\n{log_tail(log_path)}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGINT (a clean shutdown), then SIGKILL to the server's whole session (it runs in its own,
    so this also ends stage processes it may have left behind)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_mode(mode: str, args: argparse.Namespace, engine_args: list[str],
             inputs: list[serve.RequestInput]) -> dict:
    """Start a server in `mode`, benchmark it at every rate, stop it; the results of serve.benchmark."""
    port = args.port or free_port()
    cmd = server_command(mode, port, engine_args_for(mode, engine_args))
    with tempfile.NamedTemporaryFile(prefix=f"specpipe-serve-{mode}-", suffix=".log", delete=False) as log:
        print(f"[{mode}] {shlex.join(cmd)}  (log: {log.name})", flush=True)
        # the server runs this repository's specpipe, like this script, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        started = time.monotonic()
        wait_healthy(f"http://{HOST}:{port}", proc, args.startup_timeout, log.name)
        print(f"[{mode}] healthy after {time.monotonic() - started:.1f} s", flush=True)
        mode_args = copy.copy(args)
        mode_args.base_url, mode_args.label = f"http://{HOST}:{port}", mode
        return asyncio.run(serve.benchmark(mode_args, inputs))
    finally:
        stopping = time.monotonic()
        stop_server(proc, args.stop_timeout)
        print(f"[{mode}] stopped (exit code {proc.returncode}) in {time.monotonic() - stopping:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    own, engine_args = split_engine_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        inputs = serve.build_inputs(args)
        for mode in modes:
            server_command(mode, 0, engine_args_for(mode, engine_args))  # reject reserved flags before starting
    except (serve.BenchError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "benchmarks/bench_serve.py", *(sys.argv[1:] if argv is None else argv)])
    results, failures = [], {}
    for mode in modes:
        try:
            results.append(run_mode(mode, args, engine_args, inputs))
        except (ServerFailed, serve.BenchError) as e:
            print(f"[{mode}] failed: {e}", file=sys.stderr, flush=True)
            failures[mode] = str(e)
    combined = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": command, "modes": modes, "engine_args": engine_args,
                "results": results, "failures": failures}
    markdown = format_markdown(results, command) if results else f"Command: `{command}`\n\nno results\n"
    print("\n" + markdown)
    serve.write_outputs(combined, markdown, args.result_json, args.result_md)
    print(f"results: {args.result_json}")
    return 1 if failures or not results else 0


if __name__ == "__main__":
    sys.exit(main())
