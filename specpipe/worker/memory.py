"""Memory readings: the resident memory of the process a stage runs in (its weights:
model/stage.py weight_nbytes), and the memory free on a device."""

from __future__ import annotations

from pathlib import Path


def process_memory() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process, from /proc (Linux; (0, 0) elsewhere)."""
    rss = peak = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, peak


def available_memory(device: str) -> int:
    """Bytes free now on `device`: the GPU's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
