"""Local stage processes on one machine get disjoint CPUs (engine/start_pipeline.py's
local_stage_cpus, distributed/ranks.py's LocalStages): each stage process reports the affinity
mask it runs with (on a machine with no core left for the driver, local_stage_cpus leaves the
stages unpinned: the test then hands LocalStages a core each itself)."""

from __future__ import annotations

import os
import time

import pytest

from specpipe.distributed.ranks import LocalStages
from specpipe.engine.start_pipeline import local_stage_cpus

REPORTER = """
import os, sys
sys.stdin.read()  # the key, as a stage reads it
with open(sys.argv[1], "w") as f:
    f.write(",".join(map(str, sorted(os.sched_getaffinity(0)))))
"""


def test_threads_follow_the_cores_or_the_users_choice():
    cores, threads = local_stage_cpus(2)
    if cores is not None:
        assert threads == len(cores[0]) and all(len(c) == threads for c in cores)
    assert local_stage_cpus(2, threads=3)[1] == 3
    assert local_stage_cpus(2, device="cuda")[0] is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of at least 2 CPUs")
def test_two_local_stages_run_on_disjoint_cpus(tmp_path, monkeypatch):
    (tmp_path / "affinity_reporter.py").write_text(REPORTER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    chosen, _ = local_stage_cpus(2)  # None where no core is left for the driver (a 2-CPU machine)
    mask = sorted(os.sched_getaffinity(0))
    cores = chosen or [mask[:1], mask[1:2]]
    stages = LocalStages("affinity_reporter", lambda r: [str(tmp_path / f"stage{r}")], 2, b"k" * 16, cores)
    try:
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in stages.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = [{int(c) for c in (tmp_path / f"stage{r}").read_text().split(",")} for r in (1, 2)]
    finally:
        stages.stop(grace_s=0.0)
    assert seen == [set(c) for c in cores]
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] <= set(os.sched_getaffinity(0))
