"""Where SpecPipe keeps what it fetches or computes once per machine: the default model
(loader/default_model.py) and a node's weight cache and digests (cluster/weights.py). A module of
its own below both, so neither room reaches into the other for it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$SPECPIPE_CACHE_DIR, else $XDG_CACHE_HOME/specpipe, else ~/.cache/specpipe."""
    if os.environ.get("SPECPIPE_CACHE_DIR"):
        return Path(os.environ["SPECPIPE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "specpipe"


__all__ = ["cache_dir"]
