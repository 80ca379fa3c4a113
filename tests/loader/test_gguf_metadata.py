"""The GGUF metadata reader against gguf-py's own reader, and on cut-off and foreign files."""

from __future__ import annotations

import gguf
import pytest

from specpipe.loader.gguf_metadata import GGUFMetadataError, read_gguf_metadata

V = gguf.GGUFValueType
VALUES = [
    ("u8", 200, V.UINT8), ("i8", -100, V.INT8), ("u16", 60000, V.UINT16), ("i16", -30000, V.INT16),
    ("u32", 4_000_000_000, V.UINT32), ("i32", -2_000_000_000, V.INT32), ("u64", 2**63 + 5, V.UINT64),
    ("i64", -(2**62), V.INT64), ("f32", 0.25, V.FLOAT32), ("f64", 1e-300, V.FLOAT64), ("flag", True, V.BOOL),
    ("text", "naïve 😀", V.STRING), ("empty", "", V.STRING),
    ("ints", [1, 2, 3], V.ARRAY), ("floats", [0.5, -1.5], V.ARRAY), ("words", ["a", "", "ü"], V.ARRAY),
    ("nested", [[1, 2], [3]], V.ARRAY),
]


def write(path, endian=gguf.GGUFEndian.LITTLE):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    for key, value, vtype in VALUES:
        w.add_key_value(f"test.{key}", value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_matches_gguf_reader(tmp_path, endian):
    path = write(tmp_path / "m.gguf", endian)
    ours = read_gguf_metadata(path)
    fields = gguf.GGUFReader(path).fields
    for key, value, _ in VALUES:
        key = f"test.{key}"
        if key != "test.nested":  # gguf-py's contents() does not decode arrays of arrays
            assert ours[key] == fields[key].contents(), key
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value, key
    assert isinstance(ours["test.flag"], bool) and isinstance(ours["test.u8"], int)
    assert list(ours)[0] == "general.architecture"  # file order


def test_every_cut_is_one_clear_error(tmp_path):
    data = write(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for keep in range(4, len(data)):
        cut.write_bytes(data[:keep])
        try:
            meta = read_gguf_metadata(cut)
        except GGUFMetadataError as e:
            assert e.reason.startswith("truncated GGUF file (metadata needs"), (keep, e.reason)
            assert str(e).startswith(f"{cut}: ")
        else:  # only the padding after the key/values may go without being missed
            assert meta == read_gguf_metadata(tmp_path / "m.gguf"), keep


def test_foreign_and_unsupported_files(tmp_path):
    (tmp_path / "text.gguf").write_text("hello there")
    (tmp_path / "empty.gguf").write_bytes(b"")
    for name in ("text.gguf", "empty.gguf"):
        with pytest.raises(GGUFMetadataError, match=r"not a GGUF file \(bad magic"):
            read_gguf_metadata(tmp_path / name)
    data = bytearray(write(tmp_path / "m.gguf").read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    (tmp_path / "v7.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFMetadataError, match="GGUF version 7 is not supported"):
        read_gguf_metadata(tmp_path / "v7.gguf")
    with pytest.raises(GGUFMetadataError, match="cannot read GGUF metadata"):
        read_gguf_metadata(tmp_path / "absent.gguf")
    with pytest.raises(GGUFMetadataError, match="cannot read GGUF metadata"):
        read_gguf_metadata(tmp_path)  # a directory


def test_unknown_value_type_is_corrupt(tmp_path):
    data = write(tmp_path / "m.gguf").read_bytes()
    key = b"test.u8"
    at = data.index(key) + len(key)  # the value type follows the key
    bad = data[:at] + (13).to_bytes(4, "little") + data[at + 4:]
    (tmp_path / "bad.gguf").write_bytes(bad)
    with pytest.raises(GGUFMetadataError, match="corrupt GGUF file.*value type 13 for test.u8"):
        read_gguf_metadata(tmp_path / "bad.gguf")
