"""Hugging Face model directories: config.json + *.safetensors (single file or sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specpipe.config import ConfigError, ModelConfig
from specpipe.loader.checkpoint import Checkpoint, CheckpointError, check_config_against_tensors
from specpipe.loader import PICKLE_SUFFIXES


def canonical(hf_name: str) -> str:
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


class HFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.path = path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: not a Hugging Face model directory (no config.json)")
        try:
            self.config = ModelConfig.from_hf_dict(_read_json_object(cfg_file))
        except ConfigError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from None
        self._file_of: dict[str, Path] = {}  # canonical name -> shard
        self._hf_name: dict[str, str] = {}
        for shard in self._shards():
            try:
                with safe_open(shard, framework="pt") as f:
                    for name in f.keys():
                        self._file_of[canonical(name)] = shard
                        self._hf_name[canonical(name)] = name
            except Exception as e:  # safetensors raises several types for a damaged header
                raise CheckpointError(f"{shard.name}: unreadable safetensors file ({e})") from None
        self._handles: dict[Path, object] = {}
        check_config_against_tensors(self)

    def _shards(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json_object(index).get("weight_map", {})
            files = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
            # Shards are plain file names in this directory: an index is never a way to read elsewhere.
            if not all(isinstance(f, str) and f and Path(f).name == f and f not in (".", "..") for f in files):
                raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names in "
                                      "the model directory")
            shards = sorted({self.path / f for f in files})
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise CheckpointError(f"{self.path}: shards listed in the index are missing: {', '.join(missing)}")
            return shards
        shards = sorted(self.path.glob("*.safetensors"))
        if shards:
            return shards
        pickled = [p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickled:
            raise CheckpointError(
                f"{self.path}: only pickled weights ({', '.join(pickled)}) were found; they are refused "
                "because loading them can execute arbitrary code. Convert the model to safetensors.")
        raise CheckpointError(f"{self.path}: no *.safetensors weights found")

    def _handle(self, name: str):
        shard = self._file_of.get(name)
        if shard is None:
            raise CheckpointError(f"{self.path.name}: tensor {name!r} is missing from the checkpoint")
        if shard not in self._handles:
            self._handles[shard] = safe_open(shard, framework="pt")
        return self._handles[shard]

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(self._hf_name[name]).get_shape())

    def load(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """One tensor, converted to `dtype` (None: as stored, e.g. bfloat16)."""
        try:
            w = self._handle(name).get_tensor(self._hf_name[name])
            return w if dtype is None else w.to(dtype)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.path.name}: cannot read tensor {name!r} ({e})") from None

    def close(self) -> None:
        self._handles.clear()
