"""The package build compiles the native kernels (libspecpipe_native.so) into the package.

Everything else about the package is in pyproject.toml; this file only adds the C library, so
that ``pip install .``, ``pip install -e .`` and a built wheel carry it (docs/install.md).

The library is a plain C shared library loaded with ctypes, not a CPython extension, so:
- it is compiled by the same function as ``python -m specpipe.kernels.native.build`` (build.py,
  loaded by file path: specpipe is not importable while it is being built), with its OpenMP /
  no-OpenMP fallback and no -march (the SIMD paths carry their own targets and are chosen at run
  time, so one wheel serves every x86-64 CPU, one every aarch64);
- it keeps its plain name (no ``.cpython-311-...`` suffix), the one native/__init__.py loads;
- the wheel is tagged ``py3-none-<platform>``: any Python 3 on that platform, not one ABI.
The extension is optional: on a machine without a C compiler the install goes on with a warning
and SpecPipe runs on the portable torch path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent
LIB_MODULE = "specpipe.kernels.native.libspecpipe_native"


def _load_native_build():
    """specpipe/kernels/native/build.py, by file path (it needs nothing but the standard library)."""
    spec = importlib.util.spec_from_file_location("_specpipe_native_build", ROOT / "specpipe/kernels/native/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native_build = _load_native_build()


class BuildNative(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # called with the full dotted name and with its last part alone
        *package, name = fullname.split(".")
        if name == LIB_MODULE.rsplit(".", 1)[1]:
            return os.path.join(*package, native_build.LIB_NAME)
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if ext.name != LIB_MODULE:
            return super().build_extension(ext)
        out = Path(self.get_ext_fullpath(ext.name))
        if native_build.build(out=out) is None:  # it printed why
            # optional=True makes setuptools go on without it; say what that means
            print("specpipe: WARNING the native kernels were not built (see the line above); "
                  "SpecPipe will run on the portable torch path. Install a C compiler (e.g. gcc) and "
                  "reinstall, or run `python3 -m specpipe.kernels.native.build`.", file=sys.stderr)
            raise CompileError("native kernels not built")

    def copy_extensions_to_source(self) -> None:
        """Editable installs (and build_ext --inplace): put the library beside build.py's own
        output, renamed over the old one as build.py does: a running process keeps its mapping of
        the old file (distutils' copy_file would rewrite it in place)."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            if not os.path.exists(regular_file):
                continue  # optional and not built: the warning is printed
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(inplace_file)}.", suffix=".tmp",
                                       dir=os.path.dirname(inplace_file))
            os.close(fd)
            try:
                shutil.copy2(regular_file, tmp)
                os.replace(tmp, inplace_file)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)


class PlatformWheel(bdist_wheel):
    """One wheel per platform for every Python 3: the library does not link libpython."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    ext_modules=[Extension(
        LIB_MODULE,
        sources=[str(p.relative_to(ROOT)) for p in native_build.SOURCES],  # what build() compiles
        depends=[str(p.relative_to(ROOT)) for p in sorted(native_build.HERE.glob("*.h"))],
        optional=True,
    )],
    cmdclass={"build_ext": BuildNative, "bdist_wheel": PlatformWheel},
)
