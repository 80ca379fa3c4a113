"""The package as a user gets it: an sdist of a clean copy of the tree carries the sources and
setup.py, never a built library; the wheel built from it carries the native library, and installed
into a fresh virtual environment it runs the native path with no C compiler on PATH.

One build (about 15 s of CPU: the C compile) serves the module's tests.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIB = "specpipe/kernels/native/libspecpipe_native.so"
COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "ld")


def _clean_copy(dest: Path) -> Path:
    """The tracked files of the working tree (a clean clone's content, this checkout's edits)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _build_isolation_args() -> list[str]:
    """Build with this Python's setuptools when it is new enough (no download), else isolated.
    Its version is read from its metadata: importing setuptools here would fight distutils."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if (major, minor) >= (70, 1) else []


STALE = b"a library an editable install left in the tree: never shipped"


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel) as `python -m build` makes them: the sdist from a clean copy of the tree, the
    wheel from the sdist (so the sdist is shown to build, with a compiler)."""
    tree = _clean_copy(tmp_path_factory.mktemp("tree"))
    (tree / LIB).write_bytes(STALE)
    out = tmp_path_factory.mktemp("dist")
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=tree, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    sdist = out / res.stdout.split()[-1]
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *_build_isolation_args(),
                          "--wheel-dir", str(out), str(sdist)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (whl,) = out.glob("specpipe-*.whl")
    return sdist, whl


@pytest.fixture(scope="module")
def wheel(dists) -> Path:
    return dists[1]


def test_wheel_carries_the_library_for_every_python_of_its_platform(wheel):
    # py3-none-<platform>: the library is plain C (no libpython), its SIMD paths chosen at run time
    assert wheel.name.split("-")[2:4] == ["py3", "none"], wheel.name
    assert not wheel.name.endswith("-any.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        library = z.read(LIB)
    assert len(library) > 100_000 and library.startswith(b"\x7fELF")  # built, not the tree's stale file
    assert "specpipe/kernels/native/ggml_matmul.c" in names  # rebuildable: build.py's sources ship too
    assert not [n for n in names if n.endswith(".so") and n != LIB]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; torch and the rest from the system's site-packages."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=300)
    res = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root


def _no_compiler_env(venv: Path) -> dict[str, str]:
    """PATH is the venv's bin alone (checked to hold no compiler); nothing points at the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SPECPIPE_NATIVE", "CC"))}
    env["PATH"] = str(venv / "bin")
    env["PYTHONNOUSERSITE"] = "1"
    assert not [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]
    return env


def test_installed_wheel_runs_the_native_path_without_a_compiler(venv, tmp_path):
    probe = ("import json, specpipe; from specpipe.kernels import native; "
             "print(json.dumps([specpipe.__file__, str(native.library_path()), native.available(), "
             "native.unavailable_reason()]))")
    res = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=_no_compiler_env(venv),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    module, library, available, why = json.loads(res.stdout.splitlines()[-1])
    # the venv's copy, not the editable checkout the test runs from
    assert Path(module).resolve().is_relative_to(venv.resolve()), module
    assert Path(library).resolve().is_relative_to(venv.resolve()), library
    assert available, why


def test_first_generate_from_the_wheel_on_the_default_model(venv, tmp_path):
    """The issue's goal: the first `specpipe generate` of a fresh install, no extra step, runs the
    native kernel on every weight type and keeps the GGUF's blocks packed (at most 1.3x the file)."""
    from specpipe.loader.default_model import DefaultModelMissing, default_model_path

    try:  # what the venv will find (it sees the same site-packages and cache); never fetched here
        model = default_model_path(fetch=False)
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    res = subprocess.run([str(venv / "bin" / "specpipe"), "generate", "--json", "--max-tokens", "4",
                          "Name the capital of France."], cwd=tmp_path, env=_no_compiler_env(venv),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.splitlines()[-1])["stats"]
    assert stats["kernels"]["native_library"] == "loaded", stats["kernels"]
    assert set(stats["kernels"]["weights"].values()) == {"native"}, stats["kernels"]
    weight_bytes = sum(st["weight_bytes"] for st in stats["stages"])
    assert weight_bytes <= 1.3 * model.stat().st_size, (weight_bytes, model.stat().st_size)


def test_sdist_carries_the_sources_not_a_built_library(dists):
    import tarfile

    with tarfile.open(dists[0]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "specpipe/kernels/native/build.py",
            "specpipe/kernels/native/ggml_matmul.c", "specpipe/kernels/native/ggml_matmul.h"} <= names
    assert not [n for n in names if n.endswith(".so")]
