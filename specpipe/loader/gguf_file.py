"""A GGUF file's tensor directory, and reads of its tensors' bytes that fail cleanly.

At open the header and the tensor directory are parsed through a memory map (gguf-py's reader,
every read bounds-checked), and the map is dropped as soon as the directory is copied out: what
stays open is a file descriptor (checked_file.py), and a tensor's bytes are read from it, so that a
file cut short or overwritten after open is a CheckpointError naming it, never a SIGBUS. (A cut
during the parse itself, a fraction of a second, can still fault in the map, as can one during
gguf_metadata.py's walk of the key/value section.)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from specpipe.loader.checked_file import CheckedFile, closed_on_error
from specpipe.loader.checkpoint import CheckpointError


class _Truncated(Exception):
    def __init__(self, end: int, size: int) -> None:
        super().__init__(f"needs {end} bytes, file has {size}")


class _BoundedReader(gguf.GGUFReader):
    """GGUFReader whose every read is bounds-checked.

    The stock reader slices the memory map, and slicing past the end silently yields a
    short array, which then fails somewhere unrelated (a reshape, an index) or, for a
    tensor, only when its data is finally used. `_get` is the reader's single read
    primitive, so checking there turns every truncation into one clear error.
    """

    def _get(self, offset, dtype, count=1, *args, **kwargs):
        # Checked after the read, not before: this runs once per metadata string (100k+
        # times for a tokenizer), and a short result is the cheap sign of a read past the end.
        try:
            arr = super()._get(offset, dtype, count, *args, **kwargs)
        except ValueError:  # a short slice that is not a whole number of items
            arr = None
        if arr is None or len(arr) != int(count):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            raise _Truncated(end, self.data.shape[0])
        return arr

    def _build_fields(self, offs: int, count: int) -> int:
        """Skip the key/value section instead of building a numpy view per array item (the
        stock reader needs tens of seconds for a 151k-token vocabulary; the loader reads the
        metadata with loader/gguf_metadata.py). Only general.alignment, which the reader itself
        needs to find the tensor data, is built as the stock reader would."""
        order = "<" if self.byte_order == "I" else ">"
        u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
        size = self.data.shape[0]

        def read(fmt: struct.Struct, at: int) -> int:
            if at + fmt.size > size:
                raise _Truncated(at + fmt.size, size)
            return fmt.unpack_from(self.data, at)[0]

        def skip_string(at: int) -> int:
            end = at + 8 + read(u64, at)
            if end > size:
                raise _Truncated(end, size)
            return end

        def skip_value(vtype: int, at: int, depth: int = 0) -> int:
            if vtype == 8:  # string
                return skip_string(at)
            if vtype in _SCALAR_BYTES:
                return at + _SCALAR_BYTES[vtype]
            if vtype != 9 or depth > 8:  # array (nested at most a few levels in any real file)
                raise ValueError(f"unknown or too deeply nested value type {vtype}")
            etype, count = read(u32, at), read(u64, at + 4)
            at += 12
            if etype in _SCALAR_BYTES:
                end = at + count * _SCALAR_BYTES[etype]
                if end > size:
                    raise _Truncated(end, size)
                return end
            for _ in range(count):
                at = skip_value(etype, at, depth + 1)
            return at

        try:
            for _ in range(int(count)):
                start = offs
                key_end = skip_string(offs)
                key = bytes(self.data[offs + 8:key_end]).decode("utf-8", "replace")
                offs = skip_value(read(u32, key_end), key_end + 4)
                if key == "general.alignment":
                    super()._build_fields(start, 1)
            return offs
        finally:
            # skip_value refers to itself through its closure, and the cycle holds self (read's
            # self.data): broken here, the reader and its map go as soon as GGUFFile drops them,
            # not at the next garbage collection.
            del skip_value


# GGUF value type -> bytes of one item (8 = string and 9 = array are variable)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class TensorRecord:
    """One entry of the tensor directory; no bytes of the tensor itself."""

    name: str  # the GGUF name (blk.0.attn_q.weight)
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    tensor_type: gguf.GGMLQuantizationType
    data_offset: int  # where its bytes start in the file
    n_bytes: int
    dtype: np.dtype  # the stored items' numpy type (uint8 for the blocks of quantized types)
    item_shape: tuple[int, ...]  # the stored items as gguf-py shapes them (rows outermost)
    source: "GGUFFile" = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The tensor as stored (item_shape of dtype), read now into memory this process owns."""
        return self.source.read_rows(self, 0, 1, 1).reshape(self.item_shape)


class GGUFFile:
    """An open GGUF file: `tensors` (its directory) and checked reads of their bytes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        name = self.path.name
        if not self.path.exists():
            raise CheckpointError(f"model not found: {self.path}")
        if not self.path.is_file():
            raise CheckpointError(f"{name}: not a file; a GGUF checkpoint is a single .gguf file")
        self._file = CheckedFile(self.path)
        with closed_on_error(self._file):
            self._open()

    def _open(self) -> None:
        name = self.path.name
        magic = bytes(self._file.read(0, min(4, self._file.size), "the header"))
        if magic != b"GGUF":
            raise CheckpointError(f"{name}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
        self.size = self._file.size
        try:
            reader = _BoundedReader(self._file.source_path)
        except _Truncated as e:
            raise CheckpointError(f"{name}: truncated GGUF file ({e})") from None
        except Exception as e:  # the reader reports corruption as assorted ValueError/KeyError/...
            raise CheckpointError(f"{name}: corrupt GGUF file ({type(e).__name__}: {e})") from None
        if reader.byte_order != "I":
            raise CheckpointError(f"{name}: big-endian GGUF files are not supported")
        self._file.check("the tensor directory")  # the map saw the file as it was at open
        # Explicit, even though _BoundedReader already checks reads: this one uses only the
        # reader's public tensor records, so it holds if the reader's internals change.
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > self.size:
                raise CheckpointError(
                    f"{name}: truncated GGUF file (tensor {t.name} ends at byte "
                    f"{t.data_offset + t.n_bytes}, file has {self.size})"
                )
        # Copied out of the map (t.data is a view of it: only its shape and type are read here),
        # after which the reader and its map go.
        self.tensors = [TensorRecord(name=t.name, shape=tuple(int(d) for d in t.shape.tolist()),
                                     tensor_type=t.tensor_type, data_offset=int(t.data_offset),
                                     n_bytes=int(t.n_bytes), dtype=t.data.dtype, item_shape=tuple(t.data.shape),
                                     source=self)
                        for t in reader.tensors]

    @property
    def source_path(self) -> str:
        return self._file.source_path

    def read_rows(self, t: TensorRecord, first: int, end: int, rows: int) -> np.ndarray:
        """Rows [first, end) of tensor `t` counted as `rows` rows of equal bytes, as (end - first,
        row items) of its stored dtype, in memory this process owns (writable)."""
        row_bytes = t.n_bytes // rows
        buf = self._file.read(t.data_offset + first * row_bytes, (end - first) * row_bytes, f"tensor {t.name}")
        return np.frombuffer(buf, dtype=t.dtype).reshape(end - first, -1)

    def close(self) -> None:
        self._file.close()
