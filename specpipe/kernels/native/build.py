"""Build the native GGUF matmul: ``python -m specpipe.kernels.native.build``.

Compiles ggml_matmul.c, attention.c, norm_rope.c and layer.c with the system C compiler into
``libspecpipe_native.so`` next to this file (one library for every CPU: the SIMD paths carry
their own target attributes and are chosen at run time).  OpenMP is used when the compiler accepts ``-fopenmp``.  Never fails: without a working
compiler it prints one warning line and exits 0, and SpecPipe runs without the native kernels.
"""

from __future__ import annotations

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
# -ffp-contract=off: no path may fuse a multiply-add that another does not (the SIMD paths must
# give the portable path's bits).  No -march: the SIMD code has function-level targets.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


def _compile(cc: str, flags: list[str], out: Path) -> subprocess.CompletedProcess:
    cmd = [cc, *BASE_FLAGS, *flags, "-o", str(out), *map(str, SOURCES), "-lm"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def build(quiet: bool = False) -> Path | None:
    """Compile the library; return its path, or None (with a warning line) when it cannot."""
    cc = _compiler()
    if cc is None:
        print("specpipe native kernels: WARNING no C compiler found (cc); native matmul disabled")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        tmp_lib = Path(tmp) / LIB_NAME
        # The library is written to a temporary name and moved, so a running process that has
        # the old one loaded keeps a valid mapping.
        for flags, note in ((["-fopenmp"], "OpenMP"), ([], "no OpenMP: single-threaded")):
            try:
                res = _compile(cc, flags, tmp_lib)
            except (OSError, subprocess.SubprocessError) as e:  # pragma: no cover
                res = subprocess.CompletedProcess([], 1, "", str(e))
            if res.returncode == 0:
                shutil.move(str(tmp_lib), str(LIBRARY))
                if not quiet:
                    print(f"specpipe native kernels: built {LIBRARY} ({Path(cc).name}, {note})")
                return LIBRARY
        err = [ln for ln in (res.stderr or "").splitlines() if "error" in ln.lower()]
        print(
            "specpipe native kernels: WARNING build failed; native matmul disabled: "
            + (err[0].strip() if err else f"{cc} exited {res.returncode}")
        )
        return None


def main() -> int:
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
