"""specpipe/cpus.py: the quota and affinity arithmetic on fake cgroup trees, the stages' disjoint
cores, and the OpenMP wait policy's rule (set only where the user set nothing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specpipe import cpus


def _tree(tmp_path, proc: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc_cgroup").write_text(proc)
    return root, tmp_path / "proc_cgroup"


def test_v2_quota_of_the_process_cgroup(tmp_path):
    root, proc = _tree(tmp_path, "0::/kubepods/pod1\n", {"cgroup.controllers": "cpu memory\n",
                                                         "kubepods/pod1/cpu.max": "150000 100000\n"})
    assert cpus.cgroup_quota(root, proc) == pytest.approx(1.5)


def test_v2_the_smallest_quota_on_the_path_binds(tmp_path):
    root, proc = _tree(tmp_path, "0::/a/b\n", {"cgroup.controllers": "cpu\n", "a/cpu.max": "100000 100000\n",
                                               "a/b/cpu.max": "max 100000\n"})
    assert cpus.cgroup_quota(root, proc) == pytest.approx(1.0)


def test_v2_unlimited_and_missing_give_none(tmp_path):
    root, proc = _tree(tmp_path, "0::/\n", {"cgroup.controllers": "cpu\n", "cpu.max": "max 100000\n"})
    assert cpus.cgroup_quota(root, proc) is None
    assert cpus.cgroup_quota(tmp_path / "nowhere", tmp_path / "no_proc_file") is None


def test_v2_a_container_that_sees_its_cgroup_as_the_root(tmp_path):
    # /proc/self/cgroup names a path the container's mount does not have: the root's file counts
    root, proc = _tree(tmp_path, "0::/docker/abc\n", {"cgroup.controllers": "cpu\n", "cpu.max": "200000 100000\n"})
    assert cpus.cgroup_quota(root, proc) == pytest.approx(2.0)


def test_v1_cfs_quota(tmp_path):
    root, proc = _tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/x\n",
                       {"cpu,cpuacct/x/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_quota(root, proc) == pytest.approx(0.5)
    root, proc = _tree(tmp_path / "b", "3:cpu,cpuacct:/x\n",
                       {"cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_quota(root, proc) is None


def test_budget_takes_the_smaller_of_mask_and_quota():
    assert cpus.budget([0, 1, 2, 3], None, 8, probe=False).threads == 4
    b = cpus.budget([0, 1, 2, 3], 2.5, 8, probe=False)
    assert b.threads == 2 and "quota 2.5" in b.why and "affinity" in b.why
    assert cpus.budget([0, 1], 0.5, 2, probe=False).threads == 1  # never 0
    assert cpus.budget([0, 1], 8.0, 2, probe=False).threads == 2  # a quota above the mask does not bind
    assert cpus.budget(None, None, 6, probe=False).threads == 6  # macOS: the machine's count


def test_budget_of_this_process_is_within_its_mask():
    b = cpus.budget()
    mask = cpus.affinity()
    assert 1 <= b.threads <= (len(mask) if mask else (os.cpu_count() or 1))


def test_stage_cores_are_disjoint_and_leave_the_driver_one():
    assert cpus.stage_cores(2, [0, 1]) is None  # no core left for the driver: unpinned
    assert cpus.stage_cores(2, [0, 1, 2]) == [[1], [2]]  # core 0: the driver's draft thread
    assert cpus.stage_cores(2, [4, 5, 6, 7, 8]) == [[5, 6], [7, 8]]
    assert cpus.stage_cores(2, [0, 1, 2, 3], threads=1) == [[1], [2]]
    assert cpus.stage_cores(2, [0, 1, 2, 3], threads=2) is None
    assert cpus.stage_cores(3, [0, 1]) is None
    assert cpus.stage_cores(1, [0]) is None
    for n in range(1, 9):
        for s in range(1, 5):
            sets = cpus.stage_cores(s, list(range(n)))
            assert (sets is not None) == (n > s)
            if sets is not None:
                flat = [c for cs in sets for c in cs]
                assert len(flat) == len(set(flat)) and all(sets) and len(sets) == s and 0 not in flat


def test_wait_policy_only_where_the_user_set_nothing():
    env: dict = {}
    assert "set by specpipe" in cpus.set_openmp_wait_policy(env)
    assert env == cpus.WAIT_POLICY
    env = {"OMP_WAIT_POLICY": "active"}
    assert "the user's" in cpus.set_openmp_wait_policy(env) and env == {"OMP_WAIT_POLICY": "active"}
    env = {"GOMP_SPINCOUNT": "10000"}
    cpus.set_openmp_wait_policy(env)
    assert env == {"GOMP_SPINCOUNT": "10000"}


def test_the_package_sets_the_policy_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, specpipe; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "passive", out.stderr


def test_openmp_threads_capped_only_by_a_binding_quota_the_user_did_not_override():
    quota = cpus.budget([0, 1, 2, 3], 2.0, 4, probe=False)
    env: dict = {}
    assert cpus.cap_openmp_threads(env, quota) == "2" and env == {"OMP_NUM_THREADS": "2"}
    env = {"OMP_NUM_THREADS": "4"}
    assert cpus.cap_openmp_threads(env, quota) is None and env["OMP_NUM_THREADS"] == "4"
    env = {}
    assert cpus.cap_openmp_threads(env, cpus.budget([0, 1, 2, 3], None, 4, probe=False)) is None and env == {}
    assert cpus.cap_openmp_threads(env, cpus.budget([0, 1], 4.0, 4, probe=False)) is None and env == {}
