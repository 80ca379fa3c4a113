"""A checkpoint file read so that a file changed while it is open is a CheckpointError naming it,
never a crash: the GGUF (gguf_file.py) and safetensors (hf.py) loaders read tensor bytes here.

The file is held open by a descriptor from the moment the checkpoint is opened, and a tensor's
bytes are read with pread() into memory this process owns, checked against the file's size and
modification time as they were at open.

Why not a memory map: a page of a shared map whose file was cut short under it raises SIGBUS when
touched, and a private (copy-on-write) map does not help, since on Linux it too faults on pages past
the new end and shows other writers' changes in every page this process has not written. A read()
past the end just comes back short. So:
  * truncated after open: the size check refuses before the read, and a cut during the read gives
    a short read; either way a CheckpointError, never a signal;
  * overwritten in place (same inode): the modification time moves, so the check refuses;
  * replaced by a new file (rename over it, as a download or a cache does): the descriptor still
    reads the file that was opened, so the load stays consistent;
  * a change that does not move the size or the modification time (a write within the file
    system's timestamp granularity, a jiffy on Linux) is not seen: no portable way short of copying
    the file.
A read is the copy a loaded weight needs anyway (docs/quantized_weights.md: a stage owns its packed
rows rather than viewing the file's pages).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from specpipe.loader.checkpoint import CheckpointError
from specpipe.loader.weight_memory import weight_buffer


@contextmanager
def closed_on_error(f):
    """`f` (anything with close()) closed if the block raises: a file refused at open leaves no
    descriptor behind (the fuzzer opens thousands)."""
    try:
        yield f
    except BaseException:
        f.close()
        raise


class CheckedFile:
    """One checkpoint file, open for checked reads; `size` is its size at open."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)
        self._stat = os.fstat(self._file.fileno())
        self.size = self._stat.st_size

    @property
    def source_path(self) -> str:
        """A path to the very file this object holds open, for a library that wants a path (Linux's
        /proc/self/fd names it even after a rename over the original); else the original path."""
        fd_path = f"/proc/self/fd/{self._file.fileno()}"
        return fd_path if os.path.exists(fd_path) else str(self.path)

    def fileno(self) -> int:
        return self._file.fileno()

    def check(self, what: str) -> None:
        """Refuse if the file is closed, or its size or modification time moved since open."""
        if self._file.closed:
            raise CheckpointError(f"{self.path.name}: checkpoint is closed")
        now = os.fstat(self._file.fileno())
        was = self._stat.st_size
        if (now.st_size, now.st_mtime_ns) != (was, self._stat.st_mtime_ns):
            change = (f"truncated from {was} to {now.st_size} bytes" if now.st_size < was
                      else f"grown from {was} to {now.st_size} bytes" if now.st_size > was else "overwritten")
            raise CheckpointError(f"{self.path.name}: the file changed after it was opened ({change}) while "
                                  f"{what} was being read; load it again once nothing writes to it")

    def read(self, offset: int, length: int, what: str):
        """`length` bytes from `offset`, in a new writable buffer of weight memory (huge pages where
        it is large: weight_memory.py), checked before and after."""
        buf = weight_buffer(length)
        self.check(what)
        got = pread_into(self._file.fileno(), buf, offset)
        if got != length:
            raise CheckpointError(f"{self.path.name}: truncated file ({what}: read {got} of {length} bytes at "
                                  f"offset {offset}; the file was cut short after it was opened)")
        self.check(what)  # a write during the read
        return buf

    def close(self) -> None:
        self._file.close()


def pread_into(fd: int, buf, offset: int) -> int:
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
