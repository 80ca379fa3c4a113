"""A GGUF file's metadata and tensor directory, and reads of its tensors' bytes that fail cleanly.

The header is read once at open (gguf_metadata.py: pread into a buffer, every read bounds-checked);
nothing maps the file. What stays open is a file descriptor (checked_file.py), and a tensor's bytes
are read from it, so that a file cut short or overwritten, during the open or after it, is a
CheckpointError naming it, never a SIGBUS. The directory's records follow gguf-py's reader: the same
sizes, offsets and item types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from specpipe.loader.checked_file import CheckedFile, closed_on_error
from specpipe.loader.checkpoint import CheckpointError
from specpipe.loader.gguf_metadata import GGUFMetadataError, TensorInfo, read_gguf_header


# The GGML types gguf-py keeps as typed items (every other type is blocks of bytes)
_ITEM_TYPES = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
               gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
               gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
               gguf.GGMLQuantizationType.I64: np.int64}


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
        try:
            header = read_gguf_header(self._file.fileno(), self._file.size, self.path)
        except GGUFMetadataError as e:
            raise CheckpointError(f"{name}: {e.reason}") from None
        if header.big_endian:
            raise CheckpointError(f"{name}: big-endian GGUF files are not supported")
        self._metadata = header.metadata
        self.size = self._file.size
        self.tensors = [self._record(t, header.data_start) for t in header.tensors]
        self._file.check("the header")

    def _record(self, t: TensorInfo, data_start: int) -> "TensorRecord":
        """The directory entry `t` with its size and numpy view, as gguf-py's reader computes them."""
        name = self.path.name
        try:
            qtype = gguf.GGMLQuantizationType(t.type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise CheckpointError(f"{name}: corrupt GGUF file (tensor {t.name} has unknown type {t.type_id})") from None
        n_bytes = math.prod(t.dims) * type_size // block
        item_shape = tuple(reversed(t.dims))
        dtype = _ITEM_TYPES.get(qtype)
        if dtype is None:  # blocks: each row is row_values / block blocks of type_size bytes
            if not item_shape or item_shape[-1] % block:
                raise CheckpointError(f"{name}: corrupt GGUF file (tensor {t.name}'s rows of {item_shape[-1:]} values "
                                      f"are not whole {qtype.name} blocks of {block})")
            dtype, item_shape = np.uint8, item_shape[:-1] + (item_shape[-1] // block * type_size,)
        start = data_start + t.offset
        if start + n_bytes > self._file.size:
            raise CheckpointError(f"{name}: truncated GGUF file (tensor {t.name} ends at byte {start + n_bytes}, "
                                  f"file has {self._file.size})")
        return TensorRecord(name=t.name, shape=t.dims, tensor_type=qtype, data_offset=start, n_bytes=n_bytes,
                            dtype=np.dtype(dtype), item_shape=item_shape, source=self)

    def take_metadata(self) -> dict:
        """The key/value metadata, handed over once: a vocabulary is megabytes of strings, which the
        open file should not keep for the whole run."""
        meta, self._metadata = self._metadata, None
        if meta is None:
            raise RuntimeError("the metadata was taken already")
        return meta

    def read_rows(self, t: TensorRecord, first: int, end: int, rows: int) -> np.ndarray:
        """Rows [first, end) of tensor `t` counted as `rows` rows of equal bytes, as (end - first,
        row items) of its stored dtype, in memory this process owns (writable)."""
        row_bytes = t.n_bytes // rows
        buf = self._file.read(t.data_offset + first * row_bytes, (end - first) * row_bytes, f"tensor {t.name}")
        return np.frombuffer(buf, dtype=t.dtype).reshape(end - first, -1)

    def close(self) -> None:
        self._file.close()
