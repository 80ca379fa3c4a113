"""A GGUF file's tensor directory and tensor bytes, read so that a damaged file, or one changed
while it is open, is a CheckpointError naming it, never a crash.

At open the header and the tensor directory are parsed through a memory map (gguf-py's reader,
every read bounds-checked), and the map is dropped as soon as the directory is copied out: what
stays open is a file descriptor. A tensor's bytes are then read with pread() into memory this
process owns, checked against the file's size and modification time as they were at open.

Why not keep the map: a page of a shared map whose file was cut short under it raises SIGBUS when
touched, and a private (copy-on-write) map does not help, since on Linux it too faults on pages past
the new end and shows other writers' changes in every page this process has not written. A read()
past the end just comes back short. So:
  * truncated after open: the size check refuses before the read, and a cut during the read gives
    a short read; either way a CheckpointError, never a signal;
  * overwritten in place (same inode): the modification time moves, so the check refuses;
  * replaced by a new file (rename over it, as a download or a cache does): the descriptor still
    reads the file that was opened, so the load stays consistent;
  * a change that does not move the modification time within its granularity (a write through
    another process's map, flushed late) is not seen: no portable way short of copying the file.
The reads are the copy a loaded weight needs anyway (docs/quantized_weights.md: the stage owns its
packed rows rather than viewing the file's pages).
"""

from __future__ import annotations

import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

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

        for _ in range(int(count)):
            start = offs
            key_end = skip_string(offs)
            key = bytes(self.data[offs + 8:key_end]).decode("utf-8", "replace")
            offs = skip_value(read(u32, key_end), key_end + 4)
            if key == "general.alignment":
                super()._build_fields(start, 1)
        return offs


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
        self._file = open(self.path, "rb", buffering=0)
        with closed_on_error(self._file):
            self._open()

    def _open(self) -> None:
        name = self.path.name
        magic = self._file.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{name}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
        self._stat = os.fstat(self._file.fileno())
        self.size = self._stat.st_size
        try:
            reader = _BoundedReader(self.source_path)
        except _Truncated as e:
            raise CheckpointError(f"{name}: truncated GGUF file ({e})") from None
        except Exception as e:  # the reader reports corruption as assorted ValueError/KeyError/...
            raise CheckpointError(f"{name}: corrupt GGUF file ({type(e).__name__}: {e})") from None
        if reader.byte_order != "I":
            raise CheckpointError(f"{name}: big-endian GGUF files are not supported")
        self._check("the tensor directory")  # the map saw the file as it was at open
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
        """A path to the very file this object holds open (Linux's /proc/self/fd names it even after
        a rename over the original path); the path it was opened by elsewhere."""
        fd_path = f"/proc/self/fd/{self._file.fileno()}"
        return fd_path if os.path.exists(fd_path) else str(self.path)

    def _check(self, what: str) -> None:
        if self._file.closed:
            raise CheckpointError(f"{self.path.name}: checkpoint is closed")
        now = os.fstat(self._file.fileno())
        if (now.st_size, now.st_mtime_ns) != (self._stat.st_size, self._stat.st_mtime_ns):
            change = (f"truncated from {self._stat.st_size} to {now.st_size} bytes" if now.st_size < self._stat.st_size
                      else f"grown from {self._stat.st_size} to {now.st_size} bytes" if now.st_size > self._stat.st_size
                      else "overwritten")
            raise CheckpointError(f"{self.path.name}: the file changed after it was opened ({change}) while "
                                  f"{what} was being read; load it again once nothing writes to it")

    def read_rows(self, t: TensorRecord, first: int, end: int, rows: int) -> np.ndarray:
        """Rows [first, end) of tensor `t` counted as `rows` rows of equal bytes, as (end - first,
        row items) of its stored dtype, in memory this process owns (writable)."""
        row_bytes = t.n_bytes // rows
        buf = bytearray((end - first) * row_bytes)
        self._check(f"tensor {t.name}")
        got = _pread_into(self._file.fileno(), buf, t.data_offset + first * row_bytes)
        if got != len(buf):
            raise CheckpointError(f"{self.path.name}: truncated GGUF file (tensor {t.name}: read {got} of "
                                  f"{len(buf)} bytes; the file was cut short after it was opened)")
        self._check(f"tensor {t.name}")  # a write during the read
        return np.frombuffer(buf, dtype=t.dtype).reshape(end - first, -1)

    def close(self) -> None:
        self._file.close()


@contextmanager
def closed_on_error(f):
    """`f` (anything with close()) closed if the block raises: a file refused at open leaves no
    descriptor behind (the fuzzer opens thousands)."""
    try:
        yield f
    except BaseException:
        f.close()
        raise


def _pread_into(fd: int, buf: bytearray, offset: int) -> int:
    """Bytes read into `buf` from `offset` (fewer only at the end of the file). pread, not
    seek + read: a descriptor shared by threads or forked processes has one position."""
    view, done = memoryview(buf), 0
    while done < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:
            chunk = os.pread(fd, min(len(buf) - done, 1 << 30), offset + done)
            view[done:done + len(chunk)] = chunk
            n = len(chunk)
        if n == 0:
            break
        done += n
    return done
