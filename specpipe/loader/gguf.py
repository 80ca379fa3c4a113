"""GGUF checkpoints (llama.cpp's single-file format), read lazily into canonical names.

Only the header is read at open: the metadata and the tensor directory (gguf_metadata.py, the
reader the tokenizer shares; gguf_file.py makes the records). A tensor's bytes are read when `load`
asks for it, so a pipeline stage pays only for its own slice of the model; nothing maps the file, so
a file cut short or overwritten while it is open is a CheckpointError, not a SIGBUS.

Differences from the Hugging Face layout that this module undoes:
  * GGUF lists dimensions fastest-first, so its [in, out] is torch's (out, in).
  * Names, per family (gguf_families.py): llama.cpp's blk.N.* names map to canonical ones;
    stacked experts and fused tensors are row ranges of the stored tensor. DeepSeek's kv_b_proj,
    which llama.cpp splits into attn_k_b / attn_v_b, is joined back at load (gguf_sparse.py), and
    the multi-token-prediction blocks a file may carry are skipped.
  * llama.cpp's converter permutes the rows of Q and K (weights and biases) of
    llama-architecture models from Hugging Face's rotate_half RoPE layout to the
    interleaved-pairs layout llama.cpp's kernels use. Qwen2 files use llama.cpp's
    NEOX RoPE, which is the rotate_half layout already, so they are left alone.
  * Llama 3.x RoPE scaling is normally not in the metadata at all: the converter
    stores the per-frequency factor table as a `rope_freqs.weight` tensor instead.
    ModelConfig describes llama3 scaling by its four parameters, so we rebuild the
    table from the parameters and accept it only if it matches the stored one; a
    table we cannot explain is an error, because ignoring it would silently
    corrupt every position's rotation.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any, Optional

import gguf
import numpy as np
import torch

from specpipe.config import ConfigError, LinearRope, ModelConfig, RopeScaling, StageSpec
from specpipe.kernels.ggml_types import BLOCKS, FLOAT_TYPES
from specpipe.loader import gguf_families as families
from specpipe.loader import gguf_sparse as sparse
from specpipe.loader.checkpoint import (Checkpoint, CheckpointError, StageBytes, check_config_against_tensors,
                                       fused_parts, merge_ranges, stage_needs)
from specpipe.loader.checked_file import closed_on_error
from specpipe.loader.gguf_file import GGUFFile

# Architectures whose Q/K rows llama.cpp's converter permutes. llama.cpp itself calls
# Mistral (and Mixtral) "llama"; a file that says "mistral" came from a llama-style writer too.
PERMUTED_ARCHS = ("llama", "mistral")

# llama.cpp's defaults for llama3 scaling parameters the GGUF metadata has no key for.
LLAMA3_DEFAULT_LOW_FREQ_FACTOR = 1.0
LLAMA3_DEFAULT_HIGH_FREQ_FACTOR = 4.0
LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's Q/K permutation (rows only; works for biases).

    The converter does reshape(n_head, 2, rows_per_half, ...).swapaxes(1, 2): each head's
    two rotate_half halves become interleaved pairs. Swapping the same axes back on the
    (n_head, rows_per_half, 2, ...) view restores the halves.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_REQUIRED = object()


class _Metadata:
    """Typed access to GGUF key/values, with errors that name the file and the key."""

    def __init__(self, meta: dict[str, Any], file_name: str) -> None:
        self._meta = meta
        self._file = file_name

    def array_len(self, key: str) -> Optional[int]:
        value = self._meta.get(key)
        return len(value) if isinstance(value, list) else None

    def _get(self, key: str, default: Any, accepts: tuple[type, ...], what: str) -> Any:
        if key not in self._meta:
            if default is _REQUIRED:
                raise CheckpointError(f"{self._file}: metadata is missing {key}")
            return default
        value = self._meta[key]
        if isinstance(value, list):
            raise CheckpointError(f"{self._file}: metadata {key} is an array (per-layer values are not supported)")
        # bool is an int subclass, but a flag where a count belongs means a broken file.
        if isinstance(value, bool) or not isinstance(value, accepts):
            raise CheckpointError(f"{self._file}: metadata {key} should be {what}, got {value!r}")
        return value

    def get_int(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._get(key, default, (int,), "an integer")

    def get_float(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default, (int, float), "a number")
        return value if value is default else float(value)

    def get_str(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._get(key, default, (str,), "a string")

    def get_raw(self, key: str, default: Any = None) -> Any:
        """A value of any type (arrays included), unchecked."""
        return self._meta.get(key, default)


def llama3_factor_table(scaling: RopeScaling, theta: float, rope_dim: int) -> np.ndarray:
    """The per-frequency divisors convert_hf_to_gguf.py stores as rope_freqs.weight."""
    freqs = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, scaling.factor, blended))


def _rope_scaling(
    md: _Metadata, arch: str, theta: float, rope_dim: int, table: Optional[np.ndarray], file_name: str
) -> Optional[RopeScaling | LinearRope]:
    prefix = f"{arch}.rope.scaling."
    kind = md.get_str(prefix + "type", None)
    factor = md.get_float(prefix + "factor", None)
    params = dict(
        low_freq_factor=md.get_float(prefix + "low_freq_factor", LLAMA3_DEFAULT_LOW_FREQ_FACTOR),
        high_freq_factor=md.get_float(prefix + "high_freq_factor", LLAMA3_DEFAULT_HIGH_FREQ_FACTOR),
        original_max_position=md.get_int(prefix + "original_context_length", LLAMA3_DEFAULT_ORIGINAL_CONTEXT),
    )
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        scaling = None
    elif kind == "linear":  # Gemma 3's global layers (4B-27B)
        scaling = LinearRope(factor)
    elif kind == "llama3":
        if factor is None:
            raise CheckpointError(f"{file_name}: llama3 RoPE scaling without {prefix}factor")
        scaling = RopeScaling(factor=factor, **params)
    else:
        raise CheckpointError(f"{file_name}: unsupported RoPE scaling type {kind!r} (supported: llama3, linear, "
                              "and Phi-3's LongRoPE factor tensors)")

    if table is None or isinstance(scaling, LinearRope):
        return scaling
    if scaling is None:
        if np.allclose(table, 1.0):
            return None
        # The usual case for Llama 3.x: only the table is stored. Its largest entry is
        # the scaling factor; the other parameters are llama.cpp's defaults.
        scaling = RopeScaling(factor=float(table.max()), **params)
    expected = llama3_factor_table(scaling, theta, rope_dim)
    if expected.shape != table.shape or not np.allclose(table, expected, rtol=1e-4):
        raise CheckpointError(
            f"{file_name}: rope_freqs.weight is not a llama3 RoPE scaling table SpecPipe can "
            f"reproduce (tried {scaling}); this RoPE variant is not supported"
        )
    return scaling


def _read_config(meta: dict[str, Any], tensors: dict[str, Any], extras: dict[str, Any], file_name: str,
                 experts: bool, routed_layers: set[int]) -> ModelConfig:
    """tensors: canonical name -> record; extras: GGUF name -> record of the tensors that are not
    weights (rope tables); experts: the file holds expert tensors; routed_layers: layers with a router."""
    md = _Metadata(meta, file_name)
    gguf_arch = md.get_str("general.architecture")
    arch = families.model_arch(gguf_arch, experts, file_name, CheckpointError)
    key = gguf_arch  # metadata keys are prefixed with llama.cpp's name
    hidden = md.get_int(f"{key}.embedding_length")
    heads = md.get_int(f"{key}.attention.head_count")
    head_dim = md.get_int(f"{key}.attention.key_length", None)
    rope_dim = md.get_int(f"{key}.rope.dimension_count", None)
    head_dim = head_dim or rope_dim or hidden // max(heads, 1)
    rope_dim = rope_dim or head_dim
    theta = md.get_float(f"{key}.rope.freq_base", 10000.0)
    num_layers = md.get_int(f"{key}.block_count")
    context = md.get_int(f"{key}.context_length", 2048)

    # The embedding's row count is what the weights need; the metadata must agree with it
    # (llama.cpp refuses a mismatch too, so such a file is broken, not merely unusual).
    embd = tensors.get("embed_tokens.weight")
    embd_rows = int(embd.shape[-1]) if embd is not None else None  # GGUF dims: [hidden, vocab]
    vocab = md.get_int(f"{key}.vocab_size", None) or md.array_len("tokenizer.ggml.tokens") or embd_rows
    if vocab is None:
        raise CheckpointError(f"{file_name}: cannot tell the vocabulary size (no vocab_size, tokens or token_embd)")
    if embd_rows is not None and vocab != embd_rows:
        raise CheckpointError(
            f"{file_name}: vocabulary size {vocab} does not match token_embd.weight ({embd_rows} rows)"
        )

    table = None
    if "rope_freqs.weight" in extras:  # tiny (rope_dim / 2 floats), so reading it here is free
        t = extras["rope_freqs.weight"]
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise CheckpointError(f"{file_name}: rope_freqs.weight has unexpected type {t.tensor_type.name}")
        table = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)

    eos = md.get_int("tokenizer.ggml.eos_token_id", None)
    eot = md.get_int("tokenizer.ggml.eot_token_id", None)
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))  # ordered, no duplicates
    try:
        scaling = families.longrope(md, key, extras, rope_dim, context)
        options = families.family_options(md, key, arch, hidden, heads, head_dim, num_layers, routed_layers,
                                          set(tensors))
        if "rope_scaling" not in options:  # the sparse families' own (gguf_sparse.py) say theirs
            options["rope_scaling"] = scaling or _rope_scaling(md, key, theta, rope_dim, table, file_name)
        fields = dict(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=md.get_int(f"{key}.feed_forward_length"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=md.get_int(f"{key}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=md.get_float(f"{key}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=theta,
            rope_dim=rope_dim if rope_dim != head_dim else None,
            max_position=context,
            tie_word_embeddings="lm_head.weight" not in tensors,
            attention_bias=arch == "qwen2" or any(n.endswith("_proj.bias") for n in tensors),
            bos_token_id=md.get_int("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=eos_ids,
        )
        return ModelConfig(**{**fields, **options})  # a family's options override the generic reading
    except (ConfigError, ValueError) as e:
        raise CheckpointError(f"{file_name}: {e}") from None


# Tensor types that are plain arrays, not weight blocks: read as they are where read at all (a
# tensor of one that a stage needs as a weight is refused when it is loaded).
_ARRAY_TYPES = frozenset({gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16, gguf.GGMLQuantizationType.I32,
                          gguf.GGMLQuantizationType.I64, gguf.GGMLQuantizationType.F64})


def refuse_unknown_types(tensors, file_name: str) -> None:
    """A file with a tensor in a block type SpecPipe cannot compute is refused at open, naming each
    such type and a tensor of it, before any tensor is read or memory allocated for one (a stage
    would otherwise fail on that tensor after loading the others)."""
    missing: dict[str, list[str]] = {}
    for t in tensors:
        if t.tensor_type not in BLOCKS and t.tensor_type not in _ARRAY_TYPES:
            missing.setdefault(t.tensor_type.name, []).append(t.name)
    if missing:
        found = "; ".join(f"{name} ({len(ts)} tensor{'s' * (len(ts) > 1)}, e.g. {ts[0]})" for name, ts in missing.items())
        raise CheckpointError(f"{file_name}: weight type{'s' * (len(missing) > 1)} SpecPipe cannot compute: {found} "
                              f"(supported: {', '.join(q.name for q in BLOCKS)})")


class GGUFCheckpoint(Checkpoint):
    """A GGUF file seen through canonical names, torch layouts and float32 tensors."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = GGUFFile(self.path)
        with closed_on_error(self._file):
            self._open()

    def _open(self) -> None:
        refuse_unknown_types(self._file.tensors, self.path.name)
        meta = self._file.take_metadata()
        gguf_arch = meta.get("general.architecture")
        # Canonical name -> the reader's record, and for stacked or fused tensors the range of
        # its rows (counted as a 2-D tensor) that the name is. Tensors that are not weights
        # (rope_freqs, rope factor tables) stay out of names(), reachable by their GGUF name.
        self._tensors: dict[str, Any] = {}
        self._rows: dict[str, tuple[int, int]] = {}
        extras: dict[str, Any] = {}
        routed: set[int] = set()
        # DeepSeek's kv_b_proj, stored as two tensors: canonical name -> (attn_k_b, attn_v_b) records.
        self._joined: dict[str, tuple[Any, Any]] = {}
        halves: dict[tuple[int, str], Any] = {}
        self._skipped: set[int] = set()  # ids of the records of multi-token-prediction layers
        main = sparse.main_layers(meta, str(gguf_arch))
        for t in self._file.tensors:
            block = re.fullmatch(r"blk\.(\d+)\.(.+)\.(?:weight|bias)", t.name)
            layer, part = (int(block.group(1)), block.group(2)) if block else (None, None)
            if main is not None and layer is not None and layer >= main:
                self._skipped.add(id(t))
                continue
            if part in sparse.KV_B_HALVES:
                halves[layer, part] = t
                continue
            shape = tuple(reversed(t.shape))
            parts = families.canonical_parts(t.name, shape, str(gguf_arch))
            if not parts:
                extras[t.name] = t
            for name, rows in parts:
                self._tensors[name] = t
                if rows is not None:
                    self._rows[name] = rows
                if name.endswith(".mlp.gate.weight"):
                    routed.add(int(name.split(".")[1]))
        for layer in sorted({layer for layer, _ in halves}):
            pair = tuple(halves.get((layer, part)) for part in sparse.KV_B_HALVES)
            if None in pair:
                raise CheckpointError(f"{self.path.name}: layer {layer} holds one of attn_k_b / attn_v_b, not both")
            self._joined[f"layers.{layer}.{sparse.KV_B}"] = pair
        if self._skipped:
            print(f"specpipe: {self.path.name}: skipping its multi-token-prediction layers ({main} and on, "
                  f"{len(self._skipped)} tensors): SpecPipe decodes with the {main} decoder layers only",
                  file=sys.stderr, flush=True)
        self.config = _read_config(meta, self._tensors, extras, self.path.name,
                                   families.has_experts(t.name for t in self._file.tensors), routed)
        for name in [n for n in self._tensors if fused_parts(n, self.config)]:  # Phi-3's fused tensors
            t = self._tensors.pop(name)
            for part, a, b in fused_parts(name, self.config):
                self._tensors[part], self._rows[part] = t, (a, b)
        self._permuted = gguf_arch in PERMUTED_ARCHS
        check_config_against_tensors(self)

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._joined)

    def _record(self, name: str) -> Any:
        if self._file is None:
            raise CheckpointError(f"{self.path.name}: checkpoint is closed")
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path.name}: no tensor {name!r}") from None

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._record(name).shape))

    def _row_range(self, name: str) -> tuple[int, int, int]:
        """(first row, end row, rows of the stored tensor), counting it as 2-D (out, in)."""
        shape = self._stored_shape(name)
        total = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        a, b = self._rows.get(name, (0, total))
        if b > total:
            raise CheckpointError(f"{self.path.name}: {self._record(name).name} has {total} rows, the model "
                                  f"config needs {b}")
        return a, b, total

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._joined:
            k_b, v_b = self._joined[name]
            try:
                return sparse.kv_b_shape(tuple(reversed(k_b.shape)), tuple(reversed(v_b.shape)))
            except ValueError as e:
                raise CheckpointError(f"{self.path.name}: {e}") from None
        shape = self._stored_shape(name)
        if name not in self._rows:
            return shape
        a, b, _ = self._row_range(name)
        if name.endswith(".bias") and b - a == 1 and len(shape) == 2:  # one expert's bias of (E, out): gpt-oss
            return (shape[-1],)
        return (b - a, shape[-1])

    def _check_permutable(self, name: str, rows: int) -> Optional[int]:
        """The head count to un-permute `name`'s rows by, or None when it is not permuted."""
        if not (self._permuted and re.search(r"\.(q|k)_proj\.", name)):
            return None
        n_head = self.config.num_heads if ".q_proj." in name else self.config.num_kv_heads
        if rows % (2 * n_head):
            raise CheckpointError(
                f"{self.path.name}: {self._record(name).name} has {rows} rows, not a multiple of 2 x {n_head} heads")
        return n_head

    def stored_type(self, name: str) -> gguf.GGMLQuantizationType:
        return self._record(name).tensor_type

    def load_packed(self, name: str) -> tuple[gguf.GGMLQuantizationType, torch.Tensor, tuple[int, ...]]:
        """(type, rows (N, row_bytes) uint8, canonical shape) of a tensor, still in its GGML type.

        The bytes are read from the file into memory this process owns, once (gguf_file.py says
        why there is no map to view them through); the permuted Q/K rows need a copy anyway. A
        GGML block never spans two rows, so un-permuting the rows of packed bytes is un-permuting
        the weights.
        """
        t = self._record(name)
        if t.tensor_type not in BLOCKS:
            raise CheckpointError(
                f"{self.path.name}: tensor {t.name} ({name}) has type {t.tensor_type.name}, which SpecPipe cannot "
                f"compute (supported: {', '.join(q.name for q in BLOCKS)})")
        shape = self.shape(name)
        a, b, total = self._row_range(name)
        rows = b - a
        packed = self._file.read_rows(t, a, b, total).view(np.uint8).reshape(rows, -1)
        n_head = self._check_permutable(name, rows)
        if n_head is not None:
            packed = np.ascontiguousarray(unpermute_rows(packed, n_head))
        return t.tensor_type, torch.from_numpy(packed), shape

    def load(self, name: str, dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
        """Dequantized to float32 (then to `dtype` when given)."""
        if name in self._joined:  # kv_b_proj from its two halves, each read whole
            shape = self.shape(name)
            k_b, v_b = (self._dequantized(t) for t in self._joined[name])
            w = torch.from_numpy(np.ascontiguousarray(sparse.join_kv_b(k_b, v_b), dtype=np.float32)).reshape(shape)
            return w if dtype is None else w.to(dtype)
        t = self._record(name)
        shape = self.shape(name)
        a, b, total = self._row_range(name)
        try:
            # Only the name's rows are decoded: one expert of a stacked tensor, one part of a fused one.
            w = gguf.quants.dequantize(self._file.read_rows(t, a, b, total), t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path.name}: tensor {t.name} ({name}) has type {t.tensor_type.name}, "
                "which SpecPipe cannot dequantize"
            ) from None
        w = w.reshape(shape)
        n_head = self._check_permutable(name, shape[0])
        if n_head is not None:
            w = unpermute_rows(w, n_head)
        # The rows read are this process's own, writable memory; copy only what dequantize or the
        # un-permutation left non-contiguous (or not float32).
        if w.dtype != np.float32 or not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, dtype=np.float32, order="C")
        return torch.from_numpy(w) if dtype is None else torch.from_numpy(w).to(dtype)

    def kv_b_halves(self, name: str) -> Optional[tuple[tuple[gguf.GGMLQuantizationType, torch.Tensor], ...]]:
        """llama.cpp's two halves of the joined kv_b_proj `name`, each (type, rows (N, row_bytes)
        uint8) still in its GGML type: attn_k_b's H * kv_lora_rank rows of qk_nope_head_dim, then
        attn_v_b's H * v_head_dim rows of kv_lora_rank (gguf_sparse.py); None where the file keeps
        kv_b_proj whole or stores a half as float (load joins them). model/mla.py runs a head's
        block of each as one matrix (stage.py)."""
        pair = self._joined.get(name)
        if pair is None or any(t.tensor_type in FLOAT_TYPES for t in pair):
            return None
        if self._file is None:
            raise CheckpointError(f"{self.path.name}: checkpoint is closed")
        out = []
        for t in pair:
            if t.tensor_type not in BLOCKS:
                raise CheckpointError(f"{self.path.name}: tensor {t.name} has type {t.tensor_type.name}, which "
                                      f"SpecPipe cannot compute (supported: {', '.join(q.name for q in BLOCKS)})")
            shape = tuple(reversed(t.shape))
            rows = int(np.prod(shape[:-1]))
            packed = self._file.read_rows(t, 0, rows, rows).view(np.uint8).reshape(rows, -1)
            out.append((t.tensor_type, torch.from_numpy(packed)))
        return tuple(out)

    def _dequantized(self, t: Any) -> np.ndarray:
        """A whole record as float32 in its (torch-order) stored shape."""
        if self._file is None:
            raise CheckpointError(f"{self.path.name}: checkpoint is closed")
        shape = tuple(reversed(t.shape))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        try:
            return gguf.quants.dequantize(self._file.read_rows(t, 0, rows, rows), t.tensor_type).reshape(shape)
        except NotImplementedError:
            raise CheckpointError(f"{self.path.name}: tensor {t.name} has type {t.tensor_type.name}, "
                                  "which SpecPipe cannot dequantize") from None

    def stage_ranges(self, spec: StageSpec) -> StageBytes:
        """The file's preamble (header, metadata, tensor directory: everything before the first
        tensor's data) and the data of every record the stage needs. A record can back several
        canonical names (fused q/k/v, stacked experts); one that backs none (a RoPE table) is
        needed by every stage, since the config is read from it at open."""
        if self._file is None:
            raise CheckpointError(f"{self.path.name}: checkpoint is closed")
        names, rel = self.names(), self.path.name
        needed: dict[int, bool] = {}  # id(record) -> some canonical name it backs is needed
        needed.update((i, False) for i in self._skipped)  # multi-token-prediction layers: no stage's
        backing = [(name, t) for name, t in self._tensors.items()]
        backing += [(name, t) for name, pair in self._joined.items() for t in pair]
        for name, t in backing:
            needed[id(t)] = needed.get(id(t), False) or stage_needs(name, spec, names)
        size = self._file.size
        records = self._file.tensors
        ranges = [(rel, 0, min((int(t.data_offset) for t in records), default=size))]
        ranges += [(rel, int(t.data_offset), int(t.n_bytes)) for t in records if needed.get(id(t), True)]
        return StageBytes(name=rel, is_dir=False, files=[(rel, size)], ranges=merge_ranges(ranges))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._tensors = {}
        self._joined = {}
