"""Subprocess helpers for end-to-end tests: runs of the `specpipe` command line in their own
session, with stderr collected as it comes, and the processes they started found through /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

CLI = [sys.executable, "-m", "specpipe.entrypoints.cli"]
# Variables that would make a run take its role from a torchrun job: never inherited by the runs
# below (the multi-host test passes its own to its own processes only).
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GLOO_SOCKET_IFNAME", "SPECPIPE_SOCKET_IFNAME", "SPECPIPE_DEBUG")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


# -- processes ---------------------------------------------------------------------------------------

def _stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state, parent pid, start time) of a live or zombie process, from /proc; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[int]:
    """All descendants of `pid`, oldest first (so spawned stages come in rank order)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parent_of[int(entry)] = st[1]
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        out += kids
        frontier += kids
    return sorted(out, key=lambda c: ((_stat(c) or ("", 0, 0))[2], c))


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"  # a zombie has exited (nothing may reap it here)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stage_pids(cli_pid: int) -> list[int]:
    """The stage processes of a running CLI, in rank order."""
    return [p for p in descendants(cli_pid) if "specpipe.worker.stage_main" in cmdline(p)]


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_session(proc: subprocess.Popen) -> None:
    """End everything a run started (it leads its own session / process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """A CLI run in the background whose stderr is collected line by line as it comes."""

    def __init__(self, args: list[str], env: Optional[dict] = None, cmd_prefix: Optional[list[str]] = None) -> None:
        # SIGINT at its default in the child: a test started from a script in the background
        # inherits it ignored, and Python then never turns Ctrl-C into KeyboardInterrupt.
        self.proc = subprocess.Popen([*(cmd_prefix or []), *CLI, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env or clean_env(),
                                     start_new_session=True, preexec_fn=_default_sigint)
        self.err_lines: list[str] = []
        self.out = ""
        self._t_err = threading.Thread(target=self._read_err, daemon=True)
        self._t_out = threading.Thread(target=self._read_out, daemon=True)
        self._t_err.start()
        self._t_out.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err_lines.append(line)

    def _read_out(self) -> None:
        self.out = self.proc.stdout.read()

    @property
    def stderr(self) -> str:
        return "".join(self.err_lines)

    def wait_for_stderr(self, text: str, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(text in line for line in self.err_lines) < count:
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended early ({self.proc.returncode}):\n{self.stderr}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {count} x {text!r} on stderr after {timeout_s} s:\n{self.stderr}")
            time.sleep(0.05)

    def wait(self, timeout_s: float) -> int:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_session(self.proc)
            raise AssertionError(f"the run did not end within {timeout_s} s:\n{self.stderr}") from None
        self._t_err.join(5)
        self._t_out.join(5)
        return rc

    def result(self) -> dict:
        lines = [line for line in self.out.splitlines() if line.strip()]
        assert lines, f"no output; stderr:\n{self.stderr}"
        return json.loads(lines[-1])
