"""The header of a GGUF file: its key/value metadata, as plain Python values, and its tensor
directory; the one reader for both.

The model config (loader/gguf.py) and the tokenizer (tokenizer/tokenizer.py) read their settings
from here, and gguf_file.py the tensor directory. gguf.GGUFReader can read them too, but it builds
a numpy view per array element and needs ~2.5 s for SmolLM2's 49k tokens + 49k merges (walking the
header with struct takes a fortieth of that), and it reads through a memory map, where a file cut
short under the reader is a SIGBUS. Here the header is read with pread() into a buffer that grows
as the walk needs it, so nothing maps the file.

Values come back as Python types: int, float, bool, str (invalid UTF-8 replaced, as llama.cpp's
tokenizer vocabularies occasionally hold it), and lists of those for arrays. Every read is
bounds-checked, so a cut-off or corrupt file gives one GGUFMetadataError naming the file,
never a short slice that fails somewhere unrelated.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpipe.loader.checked_file import pread_into

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


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory, as the file states it."""

    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_id: int  # the GGML type's number (not checked here)
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # in file order
    tensors: list[TensorInfo]  # in file order
    data_start: int  # where the data section starts (the directory's end, aligned)
    big_endian: bool


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (v2/v3, either byte order), in file order."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return read_gguf_header(f.fileno(), os.fstat(f.fileno()).st_size, path, tensors=False).metadata
    except OSError as e:
        raise GGUFMetadataError(path, f"cannot read GGUF metadata ({e.strerror or e})") from None


def read_gguf_header(fd: int, size: int, path: Path, tensors: bool = True) -> GGUFHeader:
    """The metadata and (when `tensors`) the tensor directory of the open GGUF file `fd` of
    `size` bytes; `path` names it in errors."""
    try:
        walker = _Walker(fd, size, path)
        meta = walker.read_all()
        if not tensors:
            return GGUFHeader(meta, [], 0, walker.order == ">")
        infos, end = walker.read_tensor_infos()
        alignment = meta.get("general.alignment", 32)
        if type(alignment) is not int or alignment < 1:
            raise GGUFMetadataError(path, f"corrupt GGUF file (general.alignment is {alignment!r})")
        return GGUFHeader(meta, infos, -(-end // alignment) * alignment, walker.order == ">")
    except RecursionError:  # arrays of arrays of ..., nested deeper than any real file
        raise GGUFMetadataError(path, "corrupt GGUF file (arrays nested too deeply)") from None


class _Walker:
    """One pass over the header of an open file, read as far as the walk goes (the buffer grows
    by doubling, so a long vocabulary costs a few reads)."""

    def __init__(self, fd: int, size: int, path: Path) -> None:
        self.fd, self.path, self.size = fd, path, size
        self.buf = bytearray()
        self.part = "metadata"  # what a truncation error says was being read
        self._grow(min(4, size))
        if self.buf[:4] != b"GGUF":
            raise GGUFMetadataError(path, f"not a GGUF file (bad magic {bytes(self.buf[:4])!r}, expected b'GGUF')")
        self._need(_HEADER_BYTES)
        buf = self.buf
        # A small version number read the wrong way round has its low half zero: the file is big-endian.
        self.order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        (version,) = struct.unpack_from(self.order + "I", buf, 4)
        self._length = struct.Struct(self.order + "Q")  # a string's length; read ~100k times
        if version not in SUPPORTED_VERSIONS:
            raise GGUFMetadataError(path, f"GGUF version {version} is not supported (only 2 and 3)")

    def _grow(self, end: int) -> None:
        have = len(self.buf)
        chunk = bytearray(end - have)
        got = pread_into(self.fd, chunk, have)
        self.buf += memoryview(chunk)[:got]
        if got < len(chunk):  # the file is shorter than it was at open
            self._need(end, len(self.buf))

    def _need(self, end: int, size: int | None = None) -> None:
        # struct.unpack_from fails past the end, but a slice would quietly return less: check first.
        size = self.size if size is None else size
        if end > size:
            raise GGUFMetadataError(self.path, f"truncated GGUF file ({self.part} needs {end} bytes, file has {size})")
        if end > len(self.buf):
            self._grow(min(self.size, max(end, 2 * len(self.buf), 1 << 20)))

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
        self._end = off
        return meta

    def read_tensor_infos(self) -> tuple[list[TensorInfo], int]:
        """The tensor directory, which follows the key/values (read_all first), and where it ends:
        per tensor its name, a u32 dimension count, the u64 dimensions, a u32 type, a u64 offset."""
        self.part = "the tensor directory"
        (n_tensors,), _ = self._unpack("Q", 8)
        off, infos, names = self._end, [], set()
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,), off = self._unpack("I", off)
            self._need(off + 8 * n_dims)  # before a format of `n_dims` items
            dims, off = self._unpack(f"{n_dims}Q", off)
            (type_id, offset), off = self._unpack("IQ", off)
            if name in names:
                raise GGUFMetadataError(self.path, f"corrupt GGUF file (tensor {name} is listed twice)")
            names.add(name)
            infos.append(TensorInfo(name, tuple(dims), type_id, offset))
        return infos, off


__all__ = ["GGUFHeader", "GGUFMetadataError", "SUPPORTED_VERSIONS", "TensorInfo", "read_gguf_header",
           "read_gguf_metadata"]
