"""Hugging Face model directories: config.json + *.safetensors (single file or sharded index).

safetensors' own reader checks each shard's header at open; the tensors are then read from the
descriptors held since open (checked_file.py), not through safetensors' memory map, so that a shard
cut short or overwritten after open is a CheckpointError naming it, never a SIGBUS.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specpipe.config import ConfigError, ModelConfig, StageSpec
from specpipe.loader.checked_file import CheckedFile, closed_on_error
from specpipe.loader.hf_config import model_config_from_hf, prediction_layers
from specpipe.loader.checkpoint import (PICKLE_SUFFIXES, Checkpoint, CheckpointError, StageBytes,
                                       check_config_against_tensors, fused_parts, merge_ranges, stage_needs)
from specpipe.loader import hf_gpt_oss
from specpipe.kernels.ggml_types import dequantize


# Prefixes of the text model's tensors: plain causal LMs, and the language model inside Gemma 3's
# multimodal checkpoints (two layouts, before and after transformers 4.52); the vision tower's
# tensors keep names SpecPipe never asks for.
_PREFIXES = (("model.language_model.", ""), ("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
             ("model.", ""))
# Mixtral's and MiniMax-M2's names for the parts of a sparse MLP -> the canonical ones (Qwen3-MoE's,
# DeepSeek's and GLM-4.5's already are); MiniMax-M2 keeps the router's selection bias beside it.
_MIXTRAL = ((re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
            (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
            (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."))


def canonical(hf_name: str) -> str:
    for prefix, repl in _PREFIXES:
        if hf_name.startswith(prefix):
            hf_name = repl + hf_name[len(prefix):]
            break
    for pattern, repl in _MIXTRAL + hf_gpt_oss.RENAMES:
        hf_name = pattern.sub(repl, hf_name)
    return hf_name


def _layer_of(name: str):
    """The layer index of a canonical tensor name (layers.{i}.*), else None."""
    parts = name.split(".", 2)
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() else None


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


# safetensors' dtype names -> torch's (those SpecPipe reads; safetensors checks the names at open)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a shard's header."""

    file: CheckedFile
    name: str  # its name in the shard
    dtype: str  # safetensors' name for it
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the file
    length: int


def safetensors_header(file: CheckedFile) -> tuple[int, dict[str, _Tensor]]:
    """(where the data starts, tensor name -> _Tensor) from a shard's header: a little-endian u64
    length, then that many bytes of JSON whose data_offsets count from the end of the header. Read
    by hand because safetensors does not expose the offsets; its dtypes and shapes are taken as
    they are (safe_open has checked them against the offsets)."""
    name, size = file.path.name, file.size
    head = file.read(0, min(8, size), "the header")
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    if n is None or 8 + n > size:
        raise CheckpointError(f"{name}: unreadable safetensors file (truncated header)")
    try:
        header = json.loads(file.read(8, n, "the header"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}: unreadable safetensors file (header: {e})") from None
    start, tensors = 8 + n, {}
    for key, entry in (header.items() if isinstance(header, dict) else ()):
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] and start + offsets[1] <= size):
            raise CheckpointError(f"{name}: unreadable safetensors file (tensor {key!r} has data "
                                  f"offsets {offsets!r} outside the file)")
        tensors[key] = _Tensor(file, key, entry.get("dtype"), tuple(entry.get("shape") or ()), start + offsets[0],
                               offsets[1] - offsets[0])
    return start, tensors


class HFCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        self.path = path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: not a Hugging Face model directory (no config.json)")
        try:
            raw = _read_json_object(cfg_file)
            self.config = model_config_from_hf(raw)
            extra = prediction_layers(raw)
        except ConfigError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from None
        n = self.config.num_layers
        skipped: set[int] = set()  # multi-token-prediction layers found (hf_config.prediction_layers)
        self._tensor: dict[str, _Tensor] = {}  # canonical name -> where it is stored
        self._rows: dict[str, tuple[int, int]] = {}  # canonical name -> its rows of a fused tensor
        # gpt-oss: canonical name -> its part of a stacked expert tensor, and those tensors by name
        self._slices: dict[str, hf_gpt_oss.ExpertSlice] = {}
        self._stacked: dict[str, _Tensor] = {}
        self._recent: dict[tuple[str, int], torch.Tensor] = {}  # the last experts read (_expert)
        # shard name -> (its open file, where its data starts, its tensors by their names in it)
        self._shard_data: dict[str, tuple[CheckedFile, int, dict[str, _Tensor]]] = {}
        with closed_on_error(self):
            for shard in self._shards():
                file = CheckedFile(shard)
                self._shard_data[shard.name] = (file, 0, {})
                try:
                    with safe_open(file.source_path, framework="pt") as f:  # its checks of the header
                        keys = list(f.keys())
                except Exception as e:  # safetensors raises several types for a damaged header
                    raise CheckpointError(f"{shard.name}: unreadable safetensors file ({e})") from None
                start, tensors = safetensors_header(file)
                self._shard_data[shard.name] = (file, start, tensors)
                for name in keys:
                    layer = _layer_of(canonical(name))
                    if layer is not None and n <= layer < n + extra:
                        skipped.add(layer)
                        continue
                    slices = hf_gpt_oss.expert_slices(canonical(name), tensors[name].shape)
                    if slices is not None:
                        self._stacked[canonical(name)] = tensors[name]
                        for part, piece in slices:
                            self._tensor[part], self._slices[part] = tensors[name], piece
                        continue
                    parts = fused_parts(canonical(name), self.config)
                    for part, a, b in parts or [(canonical(name), None, None)]:
                        self._tensor[part] = tensors[name]
                        if a is not None:
                            self._rows[part] = (a, b)
            check_config_against_tensors(self)
        if skipped:
            print(f"specpipe: {path.name}: skipping its multi-token-prediction layers ({', '.join(map(str, sorted(skipped)))}"
                  f" of layers 0..{n + extra - 1}): SpecPipe decodes with the {n} decoder layers only",
                  file=sys.stderr, flush=True)

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

    def _stored(self, name: str) -> _Tensor:
        t = self._tensor.get(name)
        if t is None:
            raise CheckpointError(f"{self.path.name}: tensor {name!r} is missing from the checkpoint")
        return t

    def names(self) -> set[str]:
        return set(self._tensor)

    def shape(self, name: str) -> tuple[int, ...]:
        t = self._stored(name)
        if name in self._slices:
            return hf_gpt_oss.slice_shape(self._slices[name], t.shape)
        if name in self._rows:
            a, b = self._rows[name]
            if not t.shape or b > t.shape[0]:
                raise CheckpointError(f"{self.path.name}: fused tensor {t.name!r} has {t.shape[:1]} rows, "
                                      f"the model config needs {b}")
            return (b - a,) + t.shape[1:]
        return t.shape

    def load(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """One tensor, converted to `dtype` (None: as stored, e.g. bfloat16). Only its rows of a
        fused tensor are read."""
        t, shape = self._stored(name), self.shape(name)
        piece = self._slices.get(name)
        if piece is not None:
            if piece.kind == "mxfp4":  # for a caller that wants floats (a GPU's float32 kernel)
                w = dequantize(self.load_packed(name)[1], hf_gpt_oss.Q.MXFP4).reshape(shape)
            else:
                w = hf_gpt_oss.load_slice(piece, self._expert)
            return w if dtype is None else w.to(dtype)
        stored = _DTYPES.get(t.dtype)
        if stored is None:
            raise CheckpointError(f"{self.path.name}: tensor {t.name!r} has dtype {t.dtype}, which SpecPipe cannot "
                                  f"read (supported: {', '.join(_DTYPES)})")
        rows = t.shape[0] if t.shape else 1
        a, _ = self._rows.get(name, (0, rows))
        row_bytes = t.length // rows if rows else 0
        n = shape[0] * row_bytes if shape else t.length
        buf = t.file.read(t.offset + a * row_bytes, n, f"tensor {t.name}")
        try:
            w = torch.frombuffer(buf, dtype=stored).reshape(shape) if n else torch.empty(shape, dtype=stored)
            return w if dtype is None else w.to(dtype)
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"{self.path.name}: cannot read tensor {name!r} ({e})") from None

    def load_packed(self, name: str):
        """gpt-oss's MXFP4 experts as GGML MXFP4 rows (loader/hf_gpt_oss.py); None for the rest."""
        piece = self._slices.get(name)
        if piece is None or piece.kind != "mxfp4":
            return None
        return hf_gpt_oss.Q.MXFP4, hf_gpt_oss.packed_slice(piece, self._expert), self.shape(name)

    def stored_type(self, name: str):
        piece = self._slices.get(name)
        return hf_gpt_oss.Q.MXFP4 if piece is not None and piece.kind == "mxfp4" else None

    def _expert(self, stacked: str, e: int) -> torch.Tensor:
        """Expert e of a stacked gpt-oss tensor (E, ...), reading only its bytes. The last three read
        are kept: gate and up are halves of one stored expert, each loaded with its bias (and MXFP4
        from blocks and scales), so a stage loading them one after the other reads each once."""
        if (stacked, e) in self._recent:
            return self._recent[stacked, e]
        t = self._stacked.get(stacked)
        if t is None:
            raise CheckpointError(f"{self.path.name}: tensor {stacked!r} is missing from the checkpoint")
        stored = _DTYPES.get(t.dtype)
        if stored is None or not t.shape or not 0 <= e < t.shape[0]:
            raise CheckpointError(f"{self.path.name}: cannot read expert {e} of {t.name!r} ({t.dtype}, {t.shape})")
        n = t.length // t.shape[0]
        try:
            w = torch.frombuffer(bytearray(t.file.read(t.offset + e * n, n, f"tensor {t.name}")),
                                 dtype=stored).reshape(t.shape[1:])
        except (RuntimeError, ValueError) as err:
            raise CheckpointError(f"{self.path.name}: cannot read tensor {t.name!r} ({err})") from None
        if len(self._recent) >= 3:
            del self._recent[next(iter(self._recent))]
        self._recent[stacked, e] = w
        return w

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
        for rel, (file, start, tensors) in sorted(self._shard_data.items()):
            files.append((rel, file.size))
            ranges.append((rel, 0, start))
            for hf_name, t in tensors.items():
                parts = fused_parts(canonical(hf_name), self.config) or [(canonical(hf_name), None, None)]
                if any(stage_needs(part, spec, names) for part, _, _ in parts):
                    ranges.append((rel, t.offset, t.length))
        return StageBytes(name=self.path.name, is_dir=True, files=files, ranges=merge_ranges(ranges))

    def close(self) -> None:
        for file, _, _ in self._shard_data.values():
            file.close()
