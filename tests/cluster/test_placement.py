"""`--ray-address auto` joins only a cluster this user runs here (cluster/placement.py): never
the one another `ray start` left in /tmp/ray/ray_current_cluster while this user's own cluster
was started with --temp-dir, and never a guess among several. No Ray processes are started:
the machine's processes are faked."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest

from specpipe.cluster import placement
from specpipe.config import ConfigError

RAYLET = "/site-packages/ray/core/src/ray/raylet/raylet"


def raylet(gcs: str, temp_dir: str, uid: int) -> SimpleNamespace:
    """A raylet process as psutil shows it (its worker command is one long argument)."""
    worker = f"python default_worker.py --gcs-address={gcs} --temp-dir={temp_dir} --session-name=s"
    return SimpleNamespace(info={"cmdline": [RAYLET, "--raylet_socket_name=x", f"--gcs-address={gcs}",
                                             f"--python_worker_command={worker}"],
                                 "uids": SimpleNamespace(real=uid)})


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """This machine's processes (set `procs`), /tmp/ray under tmp_path, no RAY_ADDRESS."""
    import psutil

    procs: list = []
    monkeypatch.setattr(psutil, "process_iter", lambda attrs=None: iter(procs))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    return procs, tmp_path


def test_auto_takes_this_users_cluster_not_the_one_left_in_tmp_ray(machine):
    """The reported case: another cluster's `ray start` left its address in /tmp/ray; this
    user's cluster was started with --temp-dir and left its own elsewhere."""
    procs, tmp = machine
    (tmp / "ray" / "ray_current_cluster").write_text("10.0.0.9:6379")
    procs += [raylet("10.0.0.9:6379", "/tmp/ray", os.getuid() + 1), raylet("10.0.0.5:6390", "/home/me/raytmp", os.getuid())]
    assert placement._bootstrap_address("auto") == "10.0.0.5:6390"


def test_auto_refuses_to_guess_among_several_or_none(machine):
    procs, tmp = machine
    (tmp / "ray" / "ray_current_cluster").write_text("10.0.0.9:6379")
    procs += [raylet("10.0.0.9:6379", "/tmp/ray", os.getuid()), raylet("10.0.0.5:6390", "/home/me/raytmp", os.getuid())]
    with pytest.raises(ConfigError, match=r"several Ray clusters.*/home/me/raytmp.*--ray-address"):
        placement._bootstrap_address("auto")
    procs[:] = [raylet("10.0.0.9:6379", "/tmp/ray", os.getuid() + 1)]  # only another user's
    with pytest.raises(ConfigError, match=r"no Ray cluster of yours.*10.0.0.9:6379.*--ray-address"):
        placement._bootstrap_address("auto")


def test_an_address_given_is_taken_as_given(machine, monkeypatch):
    procs, _ = machine
    procs += [raylet("10.0.0.9:6379", "/tmp/ray", os.getuid()), raylet("10.0.0.5:6390", "/x", os.getuid())]
    assert placement._bootstrap_address("10.0.0.7:6379") == "10.0.0.7:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6390")
    assert placement._bootstrap_address("auto") == "10.0.0.5:6390"
