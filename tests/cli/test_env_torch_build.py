"""`specpipe env` names a CUDA build of torch on a machine without a GPU, and how to get the CPU build."""

import torch

from specpipe.entrypoints import env


def _problems(monkeypatch, cuda, available):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(env, "_default_model", lambda: (None, "/nonexistent"))
    return [p["problem"] + " | " + p["do"] for p in env.collect()["problems"]]


def test_cuda_build_without_gpu_is_a_problem(monkeypatch):
    found = [p for p in _problems(monkeypatch, "12.1", False) if "CUDA 12.1 build" in p]
    assert len(found) == 1, found
    assert "download.pytorch.org/whl/cpu" in found[0]


def test_cpu_build_or_gpu_present_is_not(monkeypatch):
    assert not [p for p in _problems(monkeypatch, None, False) if "CUDA" in p]
    assert not [p for p in _problems(monkeypatch, "12.1", True) if "CUDA" in p]
