"""Checkpoint loaders: Hugging Face directories and GGUF files, into one canonical naming."""

from __future__ import annotations

from pathlib import Path

from specpipe.loader.checkpoint import PICKLE_SUFFIXES, Checkpoint, CheckpointError


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a GGUF file or a Hugging Face directory (config.json + *.safetensors)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"model not found: {p}")
    if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{p.name}: pickled PyTorch checkpoints are refused because loading them can execute "
            "arbitrary code; convert the model to safetensors or GGUF"
        )
    if p.is_dir():
        from specpipe.loader.hf import HFCheckpoint

        return HFCheckpoint(p)
    from specpipe.loader.gguf import GGUFCheckpoint

    return GGUFCheckpoint(p)


__all__ = ["Checkpoint", "CheckpointError", "open_checkpoint"]
