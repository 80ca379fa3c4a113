"""Hugging Face model directories: config.json + *.safetensors (single file or sharded index)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from specpipe.config import ConfigError, ModelConfig, StageSpec
from specpipe.loader.hf_config import model_config_from_hf
from specpipe.loader.checkpoint import (Checkpoint, CheckpointError, StageBytes, check_config_against_tensors,
                                       fused_parts, merge_ranges, stage_needs)
from specpipe.loader import PICKLE_SUFFIXES


# Prefixes of the text model's tensors: plain causal LMs, and the language model inside Gemma 3's
# multimodal checkpoints (two layouts, before and after transformers 4.52); the vision tower's
# tensors keep names SpecPipe never asks for.
_PREFIXES = (("model.language_model.", ""), ("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
             ("model.", ""))
# Mixtral's names for the parts of a sparse MLP -> the canonical ones (Qwen3-MoE's already are).
_MIXTRAL = ((re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."))


def canonical(hf_name: str) -> str:
    for prefix, repl in _PREFIXES:
        if hf_name.startswith(prefix):
            hf_name = repl + hf_name[len(prefix):]
            break
    for pattern, repl in _MIXTRAL:
        hf_name = pattern.sub(repl, hf_name)
    return hf_name


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def safetensors_spans(shard: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(where the data starts, tensor name -> (offset, length) in the file) from a shard's
    header: a little-endian u64 length, then that many bytes of JSON whose data_offsets count
    from the end of the header. Read by hand because safetensors does not expose the offsets."""
    size = shard.stat().st_size
    with open(shard, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:
            raise CheckpointError(f"{shard.name}: unreadable safetensors file (truncated header)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{shard.name}: unreadable safetensors file (header: {e})") from None
    start, spans = 8 + n, {}
    for name, entry in (header.items() if isinstance(header, dict) else ()):
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] and start + offsets[1] <= size):
            raise CheckpointError(f"{shard.name}: unreadable safetensors file (tensor {name!r} has data "
                                  f"offsets {offsets!r} outside the file)")
        spans[name] = (start + offsets[0], offsets[1] - offsets[0])
    return start, spans


class HFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.path = path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: not a Hugging Face model directory (no config.json)")
        try:
            self.config = model_config_from_hf(_read_json_object(cfg_file))
        except ConfigError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from None
        self._file_of: dict[str, Path] = {}  # canonical name -> shard
        self._hf_name: dict[str, str] = {}
        self._rows: dict[str, tuple[int, int]] = {}  # canonical name -> its rows of a fused tensor
        for shard in self._shards():
            try:
                with safe_open(shard, framework="pt") as f:
                    for name in f.keys():
                        parts = fused_parts(canonical(name), self.config)
                        for part, a, b in parts or [(canonical(name), None, None)]:
                            self._file_of[part], self._hf_name[part] = shard, name
                            if a is not None:
                                self._rows[part] = (a, b)
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
        shape = tuple(self._handle(name).get_slice(self._hf_name[name]).get_shape())
        if name in self._rows:
            a, b = self._rows[name]
            if b > shape[0]:
                raise CheckpointError(f"{self.path.name}: fused tensor {self._hf_name[name]!r} has {shape[0]} rows, "
                                      f"the model config needs {b}")
            shape = (b - a,) + shape[1:]
        return shape

    def load(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """One tensor, converted to `dtype` (None: as stored, e.g. bfloat16)."""
        try:
            if name in self._rows:
                self.shape(name)  # checks the fused tensor holds the rows
                a, b = self._rows[name]
                w = self._handle(name).get_slice(self._hf_name[name])[a:b]
            else:
                w = self._handle(name).get_tensor(self._hf_name[name])
            return w if dtype is None else w.to(dtype)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.path.name}: cannot read tensor {name!r} ({e})") from None

    def stage_ranges(self, spec: StageSpec) -> StageBytes:
        """Every *.json file whole (config, index, tokenizer, generation config: small, and the
        node may want them all), and of each shard its header and the tensors the stage needs."""
        names = self.names()
        files: list[tuple[str, int]] = []
        ranges: list[tuple[str, int, int]] = []
        for f in sorted(p for p in self.path.glob("*.json") if p.is_file()):
            size = f.stat().st_size
            files.append((f.name, size))
            ranges.append((f.name, 0, size))
        for shard in self._shards():
            files.append((shard.name, shard.stat().st_size))
            start, spans = safetensors_spans(shard)
            ranges.append((shard.name, 0, start))
            for hf_name, (offset, length) in spans.items():
                parts = fused_parts(canonical(hf_name), self.config) or [(canonical(hf_name), None, None)]
                if any(stage_needs(part, spec, names) for part, _, _ in parts):
                    ranges.append((shard.name, offset, length))
        return StageBytes(name=self.path.name, is_dir=True, files=files, ranges=merge_ranges(ranges))

    def close(self) -> None:
        self._handles.clear()
