#!/usr/bin/env python3
"""Issue 57's network probes, rerun against a live `specpipe serve --stages 2` (loopback only).

Starts the server on the embedded model, finds every TCP port its processes listen on (the
rendezvous store, the ranks' link ports while they start), and then, as a stranger on the
network would:
  1. sends each port garbage, half a hello, a wrong proof, and keyless store requests;
  2. holds idle connections to every port while a stage is killed, so the stages restart under
     that pressure (it used to make every restart fail: a permanent 503);
  3. reads every stage's /proc environment and command line for the key;
and checks after each that /health is ok and a request is served with the tokens it gave before.

    python benchmarks/probe_pipeline.py [--idle 8] [--rounds 3]

Exit status 0 when every probe is refused or bounded and the server serves throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

PROMPT = {"model": "probe", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def listening_ports(pids: list[int]) -> list[int]:
    """TCP ports in LISTEN state owned by `pids` (from /proc/net/tcp and each pid's fds)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


def children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    return out


def http(port: int, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def stranger(port: int) -> None:
    from specpipe.distributed.channel import HELLO, LINK, MAGIC, STORE

    for payload in (os.urandom(64), HELLO.pack(MAGIC, STORE, 1)[:3], HELLO.pack(MAGIC, STORE, 1) + os.urandom(16),
                    HELLO.pack(MAGIC, LINK, 1) + os.urandom(16), b"GET / HTTP/1.0\r\n\r\n"):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                s.sendall(payload)
                s.settimeout(6)
                try:
                    reply = s.recv(48)
                    if len(reply) == 48:
                        s.sendall(os.urandom(32))  # a forged proof
                        s.recv(1)
                except OSError:
                    pass
        except OSError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=int, default=8, help="idle connections held to every port")
    ap.add_argument("--rounds", type=int, default=3, help="stage kills under idle connections")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "specpipe.entrypoints.cli", "serve", "--stages", "2",
                               "--port", str(port), "--stage-timeout", "10", "--served-model-name", "probe"], stderr=subprocess.PIPE, text=True)
    failures = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if http(port, "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        status, first = http(port, "/v1/completions", PROMPT)
        assert status == 200, status
        expected = first["choices"][0]["text"]

        def check(what: str) -> None:
            health = http(port, "/health", timeout=30)[0]
            status, out = http(port, "/v1/completions", PROMPT)
            same = status == 200 and out["choices"][0]["text"] == expected
            print(f"{what}: health {health}, request {status}, same text {same}")
            if health != 200 or not same:
                failures.append(what)

        stages = children(server.pid)
        ports = [p for p in listening_ports([server.pid, *stages]) if p != port]
        print(f"server pid {server.pid}, stages {stages}, pipeline ports {ports}")
        for p in ports:
            stranger(p)
        check("probes 2-4: strangers at every pipeline port")
        key_seen = []
        for pid in stages:
            for what in ("environ", "cmdline"):
                data = open(f"/proc/{pid}/{what}", "rb").read()
                if b"CLUSTER_KEY" in data:
                    key_seen.append((pid, what))
        print(f"probe 9: key in a stage's environment or command line: {key_seen or 'no'}")
        if key_seen:
            failures.append("probe 9")
        for r in range(a.rounds):
            stages = children(server.pid)
            idle = []
            for p in listening_ports([server.pid, *stages]):
                if p != port:
                    idle += [socket.create_connection(("127.0.0.1", p)) for _ in range(a.idle)]
            os.kill(stages[-1], signal.SIGKILL)
            time.sleep(0.5)
            check(f"round {r + 1}: a stage killed with {len(idle)} idle strangers connected")
            for s in idle:
                s.close()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        refused = sum("refused a connection" in line for line in (server.stderr.read() or "").splitlines())
        print(f"refusals logged by the server: {refused} lines")
    print("FAILED: " + ", ".join(failures) if failures else "every probe refused or bounded; the server served throughout")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
