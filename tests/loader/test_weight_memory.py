"""Weight memory (loader/weight_memory.py): large buffers ask for transparent huge pages, and the
bytes a tensor is read into are the file's whatever the pages are."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from specpipe.loader.weight_memory import HUGE_PAGE, weight_buffer, weight_tensor

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    try:
        return THP_MODE.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "none"


def _mapping_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) of the mapping holding `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def test_small_buffers_are_plain_bytearrays():
    assert isinstance(weight_buffer(HUGE_PAGE - 1), bytearray)
    assert weight_tensor((16, 16), torch.uint8).shape == (16, 16)


def test_off_switch(monkeypatch):
    monkeypatch.setenv("SPECPIPE_HUGE_PAGES", "0")
    assert isinstance(weight_buffer(4 * HUGE_PAGE), bytearray)


def test_large_buffer_is_writable_zeroed_and_whole():
    n = 3 * HUGE_PAGE + 12345
    buf = weight_buffer(n)
    a = np.frombuffer(buf, dtype=np.uint8)
    assert a.size == n and not a.any() and a.flags.writeable
    a[-1] = 7
    t = torch.from_numpy(a)
    assert int(t[-1]) == 7
    w = weight_tensor((4, HUGE_PAGE), torch.int16)
    w.fill_(3)
    assert w.shape == (4, HUGE_PAGE) and int(w.sum()) == 3 * 4 * HUGE_PAGE


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or _thp_mode() not in ("always", "madvise"),
                    reason="this kernel gives no transparent huge pages to a mapping that asks")
def test_large_buffer_gets_huge_pages():
    buf = weight_buffer(16 * HUGE_PAGE)
    a = np.frombuffer(buf, dtype=np.uint8)
    a[:] = 1  # touch every page
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    smaps = _mapping_of(address)
    if "THPeligible" in smaps and not smaps["THPeligible"]:
        pytest.skip("the kernel says this mapping is not eligible (THP disabled for the process)")
    # At least one whole huge page inside a 32 MiB mapping, however its start is aligned (the kernel
    # may be short of huge pages; one is the least a kernel that grants them gives here).
    assert smaps.get("AnonHugePages", 0) >= HUGE_PAGE // 1024


def test_loaded_tensor_is_the_files_bytes(tmp_path):
    from specpipe.loader.checked_file import CheckedFile

    data = np.random.default_rng(0).integers(0, 256, 2 * HUGE_PAGE + 999, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"head" + data.tobytes())
    f = CheckedFile(path)
    try:
        got = np.frombuffer(f.read(4, data.size, "a tensor"), dtype=np.uint8)
    finally:
        f.close()
    assert np.array_equal(got, data)


def test_arena_starts_on_a_huge_page():
    from specpipe.loader.weight_memory import on_huge_pages, weight_arena

    n = 3 * HUGE_PAGE + 12345
    arena = weight_arena(n)
    assert arena.dtype == torch.uint8 and arena.numel() == n
    if on_huge_pages(n):
        assert arena.data_ptr() % HUGE_PAGE == 0
    arena[-1] = 5
    assert int(arena[-1]) == 5
    assert weight_arena(100).numel() == 100  # small: ordinary memory
