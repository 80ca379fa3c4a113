"""What a stage holds in memory: its process's resident set and its model's weight bytes."""

from __future__ import annotations

from pathlib import Path

import torch


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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (packed quantized weights are buffers), each
    storage once: a tied LM head shares the embedding's."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta":
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
