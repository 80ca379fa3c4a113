"""`specpipe env` says how many threads a process gets by default, which cores two local stages
would get, why, and what the OpenMP wait policy is (issue 63)."""

from __future__ import annotations

from specpipe import cpus
from specpipe.entrypoints import env


def test_env_reports_the_threads_and_why():
    th = env._threads()
    b = cpus.budget()
    assert th["default"] == b.threads and th["why"] == b.why
    stages = th["two_local_stages"]
    if stages["cores"] is not None:
        assert len(stages["cores"]) == 2 and not set(stages["cores"][0]) & set(stages["cores"][1])
    assert stages["threads_each"] >= 1
    assert th["openmp_wait_policy"] == cpus.wait_policy_note()
    info = {"specpipe": "x", "python": "x", "ray": None, "problems": [], "threads": th,
            "torch": {"version": "x", "build": "CPU", "threads": 1, "cuda_available": False},
            "native_library": {"loaded": False, "built": False, "problem": "not built", "path": "x"},
            "kernels": {"device": "cpu", "weights": None, "model": None}, "default_model": {"path": "x", "cache": "x"}}
    text = env.format_text(info)
    assert f"threads         {b.threads} by default ({b.why})" in text
    assert "OpenMP waits" in text
