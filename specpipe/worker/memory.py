"""The resident memory of the process a stage runs in (its weights: model/stage.py weight_nbytes)."""

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
