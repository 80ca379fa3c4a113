"""Starting the ranks: S stage processes on this machine, or one rank of a torchrun job.

Local: the driver (this process) starts ranks 1..S itself, each as a program of its own (a
command line, no pickle, no re-import of the caller's script), and tears them all down on exit,
error or Ctrl-C; a stage also dies with its parent (PR_SET_PDEATHSIG), so nothing is left orphaned.
Several machines: run the same `specpipe generate` command under torchrun on every node; each
rank reads its role from RANK (0 = driver, 1..S = stages).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from specpipe.config import LinkOptions


def die_with_parent() -> None:
    """Linux: deliver SIGTERM to this process when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a multi-machine job, from torchrun's environment."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @staticmethod
    def from_environ() -> Optional["RankEnv"]:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        # torchrun's own rendezvous store listens on MASTER_PORT; ours takes the next port.
        return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")) + 1)


KEY_FILE_ENV = "SPECPIPE_CLUSTER_KEY_FILE"


def load_cluster_key(path: Optional[str], required_for: Optional[str] = None) -> Optional[bytes]:
    """The secret every rank of a job shares: the file `path` (--cluster-key-file), or the one
    SPECPIPE_CLUSTER_KEY_FILE names; None where neither is given, unless `required_for` names
    what needs one (a torchrun job: its ranks cannot agree on a key otherwise)."""
    from specpipe.config import ConfigError

    path = path or os.environ.get(KEY_FILE_ENV)
    if not path:
        if required_for:
            raise ConfigError(f"{required_for} needs a shared secret: give every rank --cluster-key-file FILE "
                              "(the same file; e.g. `head -c 32 /dev/urandom > FILE; chmod 600 FILE`), so "
                              "that no one else on the network can join or alter the pipeline")
        return None
    try:
        key = open(path, "rb").read().strip()
    except OSError as e:
        raise ConfigError(f"--cluster-key-file: cannot read {path} ({e.strerror})") from None
    if len(key) < 16:
        raise ConfigError(f"--cluster-key-file: {path} holds {len(key)} bytes; a key needs at least 16 "
                          "(e.g. head -c 32 /dev/urandom > FILE)")
    return key


class LocalStages:
    """Stage processes on this machine: `python -m <module> <argv_for_rank(r)>` for r in 1..S;
    `key` reaches each through a pipe to its standard input, never its command line or its
    environment (both readable by others: ps, /proc/PID/environ)."""

    def __init__(self, module: str, argv_for_rank: Callable[[int], list[str]], num_stages: int,
                 key: bytes, cores: Optional[list[list[int]]] = None) -> None:
        """`cores`: the CPUs of each stage (rank r gets cores[r - 1]), set on the new process at
        once, while it is still starting Python: its threads, and OpenMP's count of the CPUs
        it may use, come later and follow it."""
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for r in range(1, num_stages + 1):
                p = subprocess.Popen([sys.executable, "-m", module, *argv_for_rank(r)], stdin=subprocess.PIPE)
                self.procs[r] = p
                if cores:
                    try:
                        os.sched_setaffinity(p.pid, cores[r - 1])
                    except (AttributeError, OSError):
                        pass  # it runs unpinned (or died at once: exits() says so)
                try:
                    p.stdin.write(key.hex().encode())
                    p.stdin.close()
                except OSError:
                    pass  # it died at once: exits() says so
        except BaseException:
            self.stop(grace_s=0.0)
            raise

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def exits(self) -> dict[int, str]:
        out = {}
        for r, p in self.procs.items():
            code = p.poll()
            if code is not None:
                out[r] = f"process exited (signal {-code})" if code < 0 else f"process exited with code {code}"
        return out

    def stop(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            _wait(p, max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
                try:  # a stopped (SIGSTOP) stage acts on SIGTERM only once it runs again
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
        for p in self.procs.values():
            if not _wait(p, 2.0):
                p.kill()
                _wait(p, 1.0)


def _wait(p: subprocess.Popen, timeout_s: float) -> bool:
    """Reap `p` if it ends within the timeout; whether it has ended."""
    try:
        p.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


READY_FIELDS = ("rss_bytes", "peak_rss_bytes", "weight_bytes", "kv_bytes", "num_blocks", "block_size",
                "window_blocks")


def _ready_report(rank: int, text: str) -> dict:
    """A stage's readiness line (worker/stage_main.py writes it). One this driver cannot read comes
    from another SpecPipe (say the code was upgraded under a running server, and a restarted stage
    runs the new one): a stage failure, named, never a stray exception."""
    values = text.split()
    if len(values) != len(READY_FIELDS) or not all(v.isdigit() for v in values):
        raise RuntimeError(f"stage {rank} sent a readiness report this driver cannot read ({text[:80]!r}); "
                           f"is it running another SpecPipe version than the driver?")
    return dict(zip(READY_FIELDS, map(int, values)))


def wait_ready(store, num_stages: int, exits: Callable[[], dict[int, str]], timeout_s: float,
               progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Wait until every stage has loaded its layers; fail fast when one reports an error or dies.

    Returns each stage's readiness (stage 1 first): memory figures and its KV pool, `num_blocks`
    blocks of `block_size` slots (the driver admits requests against the smallest pool)."""
    deadline = time.monotonic() + timeout_s
    ready: dict[int, dict] = {}
    while len(ready) < num_stages:
        for r in range(1, num_stages + 1):
            if r in ready:
                continue
            if store.check([f"error/{r}"]):
                raise RuntimeError(f"stage {r} failed to start: {store.get(f'error/{r}').decode()}")
            if store.check([f"ready/{r}"]):
                ready[r] = _ready_report(r, store.get(f"ready/{r}").decode())
                if progress:
                    rep = ready[r]
                    progress(f"stage {r}/{num_stages} ready: weights {rep['weight_bytes'] / 2**20:.0f} MiB, "
                             f"KV {rep['kv_bytes'] / 2**20:.0f} MiB, resident {rep['rss_bytes'] / 2**20:.0f} MiB")
        dead = {r: why for r, why in exits().items() if r not in ready}
        if dead:
            r, why = sorted(dead.items())[0]
            raise RuntimeError(f"stage {r} failed to start: {why}")
        if time.monotonic() > deadline:
            missing = [r for r in range(1, num_stages + 1) if r not in ready]
            raise RuntimeError(f"stages {missing} not ready after {timeout_s:.0f} s")
        time.sleep(0.05)
    return [ready[r] for r in range(1, num_stages + 1)]


def stage_failure(store, num_stages: int, exits: Callable[[], dict[int, str]]) -> Optional[str]:
    """Why a stage can no longer join (it reported an error or its process ended), or None."""
    dead = exits()
    for r in range(1, num_stages + 1):
        for key in (f"failed/{r}", f"error/{r}"):
            try:
                if store.check([key]):
                    return f"stage {r} failed: {store.get(key).decode(errors='replace')}"
            except Exception:
                pass
        if r in dead:
            return f"stage {r} {dead[r]}"
    return None


__all__ = ["LinkOptions", "LocalStages", "load_cluster_key", "RankEnv", "die_with_parent", "free_port", "stage_failure", "wait_ready"]
