"""`specpipe env`: what this installation computes with, and for each problem the one thing to do.

Printed: SpecPipe's version, Python, torch (its version, CPU or CUDA build, its threads), the
native library (path, built, loads with the right ABI and block layouts, the ISA path, OpenMP),
the kernel each weight type of the model runs on (the default model unless --model), where the
default model is, the default threads and two local stages' cores and why (specpipe/cpus.py),
the OpenMP wait policy, Ray's version. `--json` prints the same as one object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

from specpipe import __version__


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory whose weight types to "
                   "report (default: the embedded SmolLM2, when it is on this machine)")
    p.add_argument("--device", default="cpu", help="the device to report the kernels for (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _default_model() -> tuple[Optional[Path], Optional[str]]:
    """(the default model's file when it is on this machine, where it would be fetched to)."""
    from specpipe.loader import default_model

    found = default_model.installed_model_path()
    cache = default_model.cached_model_path()
    if found is None and cache.is_file():
        found = cache
    return found, str(cache)


def collect(model: Optional[str] = None, device: str = "cpu") -> dict:
    import torch

    from specpipe.kernels import native

    problems: list[dict] = []
    lib = native.describe()
    if not lib["loaded"]:
        problems.append({"problem": f"native kernels not in use: {lib['problem']}",
                         "cost": "GGUF matmuls run on the portable torch kernel (a tile of rows dequantized per "
                                 "call): memory stays about the file's size, decode is about 10-15x slower than "
                                 "native (SPECPIPE_KERNEL=float32: 2-3x faster than that, 5.5x the memory)",
                         "do": f"reinstall with a C compiler (gcc or clang) present (pip install), or run "
                               f"{native.REBUILD}"})
    elif not lib["openmp"]:
        problems.append({"problem": "the native library was built without OpenMP: its matmuls use one thread",
                         "cost": "decode and prefill use one core", "do": f"install libgomp and run {native.REBUILD}"})
    cuda = torch.version.cuda
    torch_info = {"version": torch.__version__, "build": f"CUDA {cuda}" if cuda else "CPU",
                  "cuda_available": torch.cuda.is_available(), "threads": torch.get_num_threads()}
    if device.startswith("cuda") and not torch.cuda.is_available():
        problems.append({"problem": f"--device {device}, but torch cannot use a GPU ({torch_info['build']} build)",
                         "cost": "--device cuda fails", "do": "install a CUDA build of torch (pytorch.org)"})
    elif cuda and not torch.cuda.is_available():
        problems.append({"problem": f"torch is a CUDA {cuda} build, but this machine has no GPU it can use",
                         "cost": "gigabytes of CUDA libraries on disk (and in every process's import) for nothing",
                         "do": "pip uninstall torch && pip install torch --index-url "
                               "https://download.pytorch.org/whl/cpu"})
    found, cache = _default_model()
    path = Path(model) if model else found
    weights = None
    if path is not None:
        from specpipe.loader import open_checkpoint
        from specpipe.model.stage import weight_kernels

        ckpt = open_checkpoint(path)
        try:
            weights = weight_kernels(ckpt, device)
        finally:
            ckpt.close()
    if model is None and found is None:
        problems.append({"problem": "the default model is not on this machine",
                         "cost": "the first run without --model downloads it (98 MB)",
                         "do": "specpipe download (or pass --model)"})
    return {
        "specpipe": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch_info,
        "native_library": lib,
        "kernels": {"model": str(path) if path is not None else None, "device": device, "weights": weights},
        "default_model": {"path": str(found) if found is not None else None, "cache": cache},
        "ray": _version("ray"),
        "threads": _threads(),
        "problems": problems,
    }


def _threads() -> dict:
    """The threads a process gets by default, the cores two local stages would get, and why
    (specpipe/cpus.py)."""
    from specpipe import cpus
    from specpipe.engine.start_pipeline import local_stage_cpus

    b = cpus.budget()
    cores, per_stage = local_stage_cpus(2)
    return {"default": b.threads, "why": b.why, "affinity": b.cpus, "cgroup_quota": b.quota,
            "two_local_stages": {"cores": cores, "threads_each": per_stage},
            "openmp_wait_policy": cpus.wait_policy_note()}


def format_text(info: dict) -> str:
    t, lib, k, th = info["torch"], info["native_library"], info["kernels"], info["threads"]
    if lib["loaded"]:
        native_line = (f"{lib['path']} (loaded, ABI {lib['abi_version']}; ISA {lib['isa']} of "
                       f"{', '.join(lib['isas_supported'])}; OpenMP {'yes' if lib['openmp'] else 'no'})")
    else:
        native_line = lib["problem"] if not lib["built"] else f"{lib['path']} (refused: {lib['problem']})"
    weights = ", ".join(f"{q}: {kern}" for q, kern in (k["weights"] or {}).items()) or "(no model to read)"
    lines = [
        f"specpipe        {info['specpipe']}",
        f"python          {info['python']}",
        f"torch           {t['version']}, {t['build']} build, {t['threads']} threads"
        f"{', a GPU is usable' if t['cuda_available'] else ''}",
        f"native library  {native_line}",
        f"kernels ({k['device']})   {weights}" + (f"  [{k['model']}]" if k["model"] else ""),
        f"default model   {info['default_model']['path'] or 'not here (fetched to ' + info['default_model']['cache'] + ')'}",
        f"threads         {th['default']} by default ({th['why']}); two local stages: "
        + (f"cores {th['two_local_stages']['cores']}, {th['two_local_stages']['threads_each']} threads each"
           if th["two_local_stages"]["cores"] else f"unpinned ({th['two_local_stages']['threads_each']} threads each; "
           "pinned only with a CPU for each stage and one for the driver)"),
        f"OpenMP waits    {th['openmp_wait_policy']}",
        f"ray             {info['ray'] or 'not installed (only --cluster ray needs it: pip install ray)'}",
    ]
    for p in info["problems"]:
        lines.append(f"problem: {p['problem']} ({p['cost']}). To fix: {p['do']}")
    if not info["problems"]:
        lines.append("no problems found")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    info = collect(args.model, args.device)
    print(json.dumps(info) if args.json else format_text(info))
    return 0
