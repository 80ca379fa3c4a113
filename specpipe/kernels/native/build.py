"""Build the native GGUF matmul: ``python -m specpipe.kernels.native.build``.

Compiles ggml_matmul.c, attention.c, norm_rope.c and layer.c with the system C compiler into
``libspecpipe_native.so`` next to this file (one library for every CPU: the SIMD paths carry
their own target attributes and are chosen at run time).  OpenMP is used when the compiler
accepts ``-fopenmp``.  Never fails: without a working compiler it prints one warning line and
exits 0, and SpecPipe runs without the native kernels.  The package build (setup.py: ``pip
install .``, ``pip install -e .``, a wheel) compiles the library with this module's ``build()``.

``--sanitize address`` builds an AddressSanitizer variant (by default
``$TMPDIR/specpipe-asan/libspecpipe_native_asan.so``, never replacing the library); run it with
``SPECPIPE_NATIVE_LIBRARY=<path>``, ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)`` and
``ASAN_OPTIONS=detect_leaks=0`` (docs/native_kernels.md, "The boundary").  ``--out PATH``
writes the library elsewhere.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "ggml_matmul.c", HERE / "attention.c", HERE / "norm_rope.c", HERE / "layer.c"]
LIB_NAME = "libspecpipe_native.so"
LIBRARY = HERE / LIB_NAME
ASAN_LIBRARY = Path(tempfile.gettempdir()) / "specpipe-asan" / "libspecpipe_native_asan.so"
# -ffp-contract=off: no path may fuse a multiply-add that another does not (the SIMD paths must
# give the portable path's bits).  No -march: the SIMD code has function-level targets.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]
SANITIZE_FLAGS = {"address": ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]}


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


def _compile(cc: str, flags: list[str], out: Path, sources: list[Path]) -> subprocess.CompletedProcess:
    cmd = [cc, *BASE_FLAGS, *flags, "-o", str(out), *map(str, sources), "-lm"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def build(quiet: bool = False, *, out: Path | None = None, sanitize: str | None = None,
          extra_flags: list[str] | None = None, sources: list[Path] | None = None) -> Path | None:
    """Compile the library into `out` (default: LIBRARY, or ASAN_LIBRARY with sanitize="address");
    return its path, or None (with a warning line) when it cannot.

    The library is compiled to a temporary file in `out`'s own directory and renamed over `out`
    (os.replace, atomic on one filesystem): a process that has the old library mapped keeps the
    old file, whatever TMPDIR is.  (Moving from TMPDIR on another filesystem, a tmpfs, copied the
    new bytes into the old file in place, under the running server's mappings.)"""
    out = Path(out) if out is not None else ASAN_LIBRARY if sanitize else LIBRARY
    flags = [*SANITIZE_FLAGS[sanitize]] if sanitize else []
    flags += extra_flags or []
    cc = _compiler()
    if cc is None:
        print("specpipe native kernels: WARNING no C compiler found (cc); native matmul disabled")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp_lib = Path(tmp_name)
    try:
        for omp, note in ((["-fopenmp"], "OpenMP"), ([], "no OpenMP: single-threaded")):
            try:
                res = _compile(cc, [*omp, *flags], tmp_lib, sources or SOURCES)
            except (OSError, subprocess.SubprocessError) as e:  # pragma: no cover
                res = subprocess.CompletedProcess([], 1, "", str(e))
            if res.returncode == 0:
                os.chmod(tmp_lib, 0o755)
                os.replace(tmp_lib, out)
                if not quiet:
                    print(f"specpipe native kernels: built {out} ({Path(cc).name}, {note}"
                          + (f", {sanitize} sanitizer" if sanitize else "") + ")")
                return out
    finally:
        tmp_lib.unlink(missing_ok=True)
    err = [ln for ln in (res.stderr or "").splitlines() if "error" in ln.lower()]
    print("specpipe native kernels: WARNING build failed; native matmul disabled: "
          + (err[0].strip() if err else f"{cc} exited {res.returncode}"))
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specpipe.kernels.native.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--sanitize", choices=sorted(SANITIZE_FLAGS), help="build a sanitizer variant (not the library)")
    p.add_argument("--out", type=Path, help="where to write the library")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="a C macro for an experimental variant (e.g. SP_PF_BYTES=8192; use with --out)")
    args = p.parse_args(argv)
    build(out=args.out, sanitize=args.sanitize, extra_flags=[f"-D{d}" for d in args.define])
    return 0


if __name__ == "__main__":
    sys.exit(main())
