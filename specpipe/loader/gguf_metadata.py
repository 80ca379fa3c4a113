"""The key/value metadata of a GGUF file, as plain Python values: the one reader for it.

The model config (loader/gguf.py) and the tokenizer (tokenizer/tokenizer.py) both read their
settings from here. gguf.GGUFReader can read metadata too, but it builds a numpy view per array
element and needs ~2.5 s for SmolLM2's 49k tokens + 49k merges; walking the header with struct
takes a fortieth of that. Tensors are not read here (the loader reads them through GGUFReader).

Values come back as Python types: int, float, bool, str (invalid UTF-8 replaced, as llama.cpp's
tokenizer vocabularies occasionally hold it), and lists of those for arrays. Every read is
bounds-checked, so a cut-off or corrupt file gives one GGUFMetadataError naming the file,
never a short slice that fails somewhere unrelated.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

SUPPORTED_VERSIONS = (2, 3)
# GGUF value type -> struct format of one item; 8 (string) and 9 (array) are handled apart.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_HEADER_BYTES = 24  # magic, version, tensor count, key/value count


class GGUFMetadataError(ValueError):
    """A GGUF file whose metadata cannot be read. `reason` is one line for the user; callers
    name the file their own way (the loader by its name, the tokenizer by its path)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (v2/v3, either byte order), in file order."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                f.seek(0)
                raise GGUFMetadataError(path, f"not a GGUF file (bad magic {f.read(4)!r}, expected b'GGUF')")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _Walker(buf, path).read_all()
    except RecursionError:  # arrays of arrays of ..., nested deeper than any real file
        raise GGUFMetadataError(path, "corrupt GGUF file (arrays nested too deeply)") from None
    except OSError as e:
        raise GGUFMetadataError(path, f"cannot read GGUF metadata ({e.strerror or e})") from None


class _Walker:
    """One pass over the header and key/value section of a memory-mapped file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.size = buf, path, len(buf)
        self._need(_HEADER_BYTES)
        # A small version number read the wrong way round has its low half zero: the file is big-endian.
        self.order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        (version,) = struct.unpack_from(self.order + "I", buf, 4)
        self._length = struct.Struct(self.order + "Q")  # a string's length; read ~100k times
        if version not in SUPPORTED_VERSIONS:
            raise GGUFMetadataError(path, f"GGUF version {version} is not supported (only 2 and 3)")

    def _need(self, end: int) -> None:
        # struct.unpack_from fails past the end, but a slice would quietly return less: check first.
        if end > self.size:
            raise GGUFMetadataError(self.path, f"truncated GGUF file (metadata needs {end} bytes, file has {self.size})")

    def _unpack(self, fmt: str, off: int) -> tuple[tuple, int]:
        fmt = self.order + fmt
        end = off + struct.calcsize(fmt)
        self._need(end)
        return struct.unpack_from(fmt, self.buf, off), end

    def _string(self, off: int) -> tuple[str, int]:
        self._need(off + 8)
        (n,) = self._length.unpack_from(self.buf, off)
        off += 8
        self._need(off + n)
        return self.buf[off:off + n].decode("utf-8", "replace"), off + n

    def _value(self, vtype: int, off: int, key: str) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(off)
        if vtype in _SCALAR:
            (v,), off = self._unpack(_SCALAR[vtype], off)
            return v, off
        if vtype != _ARRAY:
            raise GGUFMetadataError(self.path, f"corrupt GGUF file (unknown value type {vtype} for {key})")
        (etype, count), off = self._unpack("IQ", off)
        if etype in _SCALAR:  # numbers: one unpack for the whole array
            self._need(off + count * struct.calcsize(self.order + _SCALAR[etype]))  # before a format of `count` items
            items, off = self._unpack(f"{count}{_SCALAR[etype]}", off)
            return list(items), off
        items = []
        for _ in range(count):
            item, off = self._value(etype, off, key)
            items.append(item)
        return items, off

    def read_all(self) -> dict[str, Any]:
        (n_kv,), off = self._unpack("Q", 16)
        meta: dict[str, Any] = {}
        off = _HEADER_BYTES
        for _ in range(n_kv):
            key, off = self._string(off)
            (vtype,), off = self._unpack("I", off)
            meta[key], off = self._value(vtype, off, key)
        return meta


__all__ = ["GGUFMetadataError", "SUPPORTED_VERSIONS", "read_gguf_metadata"]
