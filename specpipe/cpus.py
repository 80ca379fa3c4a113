"""The CPUs this process may use, how many threads to run on them, and how those threads wait.

Threads come from what the process may use, not from the machine's count (os.cpu_count()): its
affinity mask (taskset, a container's cpuset) and its cgroup CPU quota (docker --cpus,
Kubernetes limits: cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us), the smaller
of the two; a quota of 1.5 CPUs gives 1 thread, as a second thread would be throttled. Where
such a quota binds, the package sets OMP_NUM_THREADS to it on import (`cap_openmp_threads`;
OpenMP and torch would otherwise count the mask), unless the user set it.

Local stages on one machine get disjoint cores (`stage_cores`) where there are enough for every
stage and one more, the first, for the driver (its step loop and draft thread): two stages that
share a core each wait, at every parallel region's end, for a thread the other has descheduled.
With no core left for the driver they stay unpinned: two stages pinned to the two cores of the
loaded 2-vCPU EPYC decoded at 39.9 ms a token against 23 unpinned (median of 4 runs each), the
driver and other processes then always falling on a stage's core instead of the least busy one.

The OpenMP runtime (libgomp, which torch and the native kernels share in one process) spins
about 300,000 times before its idle threads sleep: on a core that another process needs, that
spinning and the waits behind a descheduled thread made a 2-thread decode 6-18x slower than one
thread (benchmarks/bench_contention.py, docs/benchmarks.md). `set_openmp_wait_policy` asks for
the passive policy, which it reads once, when it loads: so the package does it on import, before
torch is imported, and only where the user set neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT.

Nothing here imports torch; every function has a fallback for systems without
os.sched_getaffinity (macOS) or without cgroups.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
WAIT_POLICY = {"OMP_WAIT_POLICY": "passive"}
_policy_note: Optional[str] = None  # what set_openmp_wait_policy did, for `specpipe env`


def affinity() -> Optional[list[int]]:
    """The CPU ids this process may run on, or None where the system does not say (macOS)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _v2_quota(text: str) -> Optional[float]:
    """cpu.max is "QUOTA PERIOD" or "max PERIOD": CPUs, or None when unlimited."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    quota, period = int(parts[0]), int(parts[1])
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except OSError:
        return None


def _ancestors(root: Path, rel: str) -> list[Path]:
    """The cgroup directory of `rel` under `root` and each one above it up to `root` (a quota
    set on a parent limits its children too); only the root when `rel` is not there (a
    container that sees its own cgroup as its root)."""
    parts = [p for p in rel.strip().split("/") if p]
    dirs = [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()] or [root]


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Optional[float]:
    """This process's cgroup CPU quota in CPUs (the smallest along its cgroup path), or None when
    there is none or no cgroup file says."""
    lines = (_read(proc_cgroup) or "").splitlines()
    quotas: list[float] = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hid == "0" and controllers == "":  # cgroup v2's unified hierarchy (hybrid systems: under unified/)
            v2 = root if (root / "cgroup.controllers").exists() or not (root / "unified").is_dir() else root / "unified"
            for d in _ancestors(v2, rel):
                q = _v2_quota(_read(d / "cpu.max") or "")
                if q is not None:
                    quotas.append(q)
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller
            mount = next((root / n for n in (controllers, "cpu,cpuacct", "cpu") if (root / n).is_dir()), None)
            for d in _ancestors(mount, rel) if mount is not None else []:
                quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                try:
                    q, p = int(quota or -1), int(period or 0)
                except ValueError:
                    continue
                if q > 0 and p > 0:
                    quotas.append(q / p)
    return min(quotas) if quotas else None


@dataclass(frozen=True)
class CpuBudget:
    """What this process may use: its CPU ids (None: unknown), its quota in CPUs (None: none),
    the threads that gives, and why (one line for `specpipe env`)."""

    cpus: Optional[list[int]]
    quota: Optional[float]
    threads: int
    why: str


def budget(cpus: Optional[list[int]] = None, quota: Optional[float] = None, machine: Optional[int] = None,
           *, probe: bool = True) -> CpuBudget:
    """The default thread count: min(the affinity mask's CPUs, the quota rounded down), at least
    one. probe=False takes `cpus`, `quota` and `machine` (os.cpu_count()) as given (tests)."""
    if probe:
        cpus, quota, machine = affinity(), cgroup_quota(), os.cpu_count()
    machine = machine or 1
    n = len(cpus) if cpus else machine
    why = [f"{n} CPUs in this process's affinity mask" + (f" of the machine's {machine}" if n != machine else "")
           if cpus else f"{machine} CPUs (os.cpu_count(); this system reports no affinity mask)"]
    threads = n
    if quota is not None:
        capped = max(1, math.floor(quota + 1e-9))
        why.append(f"cgroup CPU quota {quota:g} CPUs" + (f" -> {capped}" if capped < n else " (not binding)"))
        threads = min(threads, capped)
    return CpuBudget(cpus, quota, max(1, threads), "; ".join(why))


def default_threads() -> int:
    """Threads for one process that has this machine (what it may use) to itself."""
    return budget().threads


def stage_cores(num_stages: int, cpus: Optional[list[int]] = None, threads: int = 0) -> Optional[list[list[int]]]:
    """Disjoint CPU sets for `num_stages` local stage processes, the first CPU kept off them for
    the driver; None where there are not that many CPUs (the stages then run unpinned) or the
    system cannot pin. `cpus`: the CPUs to share out (default: this process's affinity mask, cut
    to the quota); `threads`: threads per stage asked for (0: share out all but the driver's)."""
    if cpus is None:
        b = budget()
        cpus = b.cpus[:b.threads] if b.cpus else None
    if not cpus or num_stages < 1 or not hasattr(os, "sched_setaffinity"):
        return None
    free = list(cpus)[1:]  # the first: the driver's
    per = threads or len(free) // num_stages
    if per < 1 or per * num_stages > len(free):
        return None
    return [free[i * per:(i + 1) * per] for i in range(num_stages)]


def set_openmp_wait_policy(env: Optional[dict] = None) -> str:
    """Ask the OpenMP runtime for the passive wait policy (WAIT_POLICY) unless the user set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT; return what was done, in words. libgomp reads its
    environment once, when it loads: set after `import torch`, it changes nothing, and says so."""
    global _policy_note
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        note = "the user's: " + ", ".join(f"{k}={env[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in env)
    else:
        env.update(WAIT_POLICY)
        note = ", ".join(f"{k}={v}" for k, v in WAIT_POLICY.items()) + " (set by specpipe)"
        if "torch" in sys.modules and env is os.environ:
            note += ", but torch was imported first: its OpenMP runtime keeps its default (spin)"
    if env is os.environ:
        _policy_note = note
    return note


def cap_openmp_threads(env: Optional[dict] = None, b: Optional[CpuBudget] = None) -> Optional[str]:
    """Where a cgroup quota allows fewer threads than the affinity mask has CPUs (which is all
    OpenMP and torch count by default), set OMP_NUM_THREADS to the budget, unless the user set
    it; return it (None when nothing was set). Like the wait policy, read when libgomp loads."""
    env = os.environ if env is None else env
    b = b or budget()
    if "OMP_NUM_THREADS" in env or b.quota is None or b.threads >= (len(b.cpus) if b.cpus else os.cpu_count() or 1):
        return None
    env["OMP_NUM_THREADS"] = str(b.threads)
    return env["OMP_NUM_THREADS"]


def wait_policy_note() -> str:
    """What set_openmp_wait_policy did in this process (for `specpipe env`)."""
    return _policy_note or "not set: the OpenMP runtime's default (spin about 300,000 times before sleeping)"
