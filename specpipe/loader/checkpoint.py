"""The one interface every checkpoint format implements, in canonical tensor names.

Canonical names are Hugging Face's Llama names without the leading "model.":
  embed_tokens.weight                       (vocab, hidden)
  layers.{i}.input_layernorm.weight         (hidden,)
  layers.{i}.self_attn.{q,k,v,o}_proj.weight (out, in)   -- torch Linear layout
  layers.{i}.self_attn.{q,k,v}_proj.bias    (out,)        -- Qwen2 only
  layers.{i}.post_attention_layernorm.weight (hidden,)
  layers.{i}.mlp.{gate,up,down}_proj.weight (out, in)
  norm.weight                               (hidden,)
  lm_head.weight                            (vocab, hidden) -- absent when tied to the embedding
and, for the families that have them:
  layers.{i}.self_attn.{q,k}_norm.weight    (head_dim,)   -- Qwen3, Gemma 3
  layers.{i}.{pre,post}_feedforward_layernorm.weight (hidden,) -- Gemma 3 (whose
                                            post_attention_layernorm normalises the attention output)
  layers.{i}.mlp.gate.weight                (experts, hidden) -- the router of a sparse MLP
  layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   -- expert e (Mixtral, Qwen3-MoE, DeepSeek)
  layers.{i}.mlp.gate.e_score_correction_bias (experts,) -- the router's selection bias (DeepSeek V3)
  layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight -- the always-on shared expert (DeepSeek)
  layers.{i}.self_attn.sinks                (heads,)      -- gpt-oss's attention sinks, which also has
  layers.{i}.self_attn.o_proj.bias, layers.{i}.mlp.gate.bias (the router's, on its logits) and
  layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.bias (loader/hf_gpt_oss.py unstacks its experts)
  layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj}.weight
                                            -- latent attention (DeepSeek V2/V3, model/mla.py), whose
                                            q_proj (no query LoRA) and o_proj keep the names above
Fused tensors (Phi-3's qkv_proj and gate_up_proj, GGUF's stacked experts) are seen as these
names, each a range of the stored tensor's rows, so the model never sees the fusion.
The model's parameter names are these names, so loading is a checked copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from specpipe.config import ModelConfig, StageSpec

if TYPE_CHECKING:  # only annotations need torch: the tokenizer imports this package without it
    import torch


def fused_parts(name: str, cfg: ModelConfig) -> Optional[list[tuple[str, int, int]]]:
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: the canonical tensors
    they hold, as (name, first row, end row) of the fused matrix; None for any other tensor."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for fused, parts in ((".self_attn.qkv_proj.", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
                         (".mlp.gate_up_proj.", (("gate_proj", cfg.intermediate_size),
                                                 ("up_proj", cfg.intermediate_size)))):
        if fused in name:
            out, row = [], 0
            for part, rows in parts:
                out.append((name.replace(fused, f".{fused.split('.')[1]}.{part}."), row, row + rows))
                row += rows
            return out
    return None


# Pickled checkpoints, which SpecPipe refuses to open (unpickling runs code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is meant for the user."""


@dataclass(frozen=True)
class StageBytes:
    """What one pipeline stage reads of a checkpoint's files, without their contents.

    A copy that holds these ranges at the same offsets, in files of the same sizes (the rest
    left as holes), opens and builds the stage exactly like the original: the loaders find every
    header and tensor where they expect it. Small, plain data, so it can travel to another node.
    """

    name: str  # the checkpoint's file (GGUF) or directory (Hugging Face) name
    is_dir: bool  # a directory of files (Hugging Face) rather than one file (GGUF)
    files: list[tuple[str, int]]  # (path relative to the root, size in bytes)
    ranges: list[tuple[str, int, int]]  # (path relative to the root, offset, length): sorted, merged

    @property
    def total(self) -> int:
        """Bytes the stage needs (the sum of the ranges)."""
        return sum(length for _, _, length in self.ranges)

    def root_of(self, path: Path) -> Path:
        """The directory the relative paths start from, for the checkpoint at `path`."""
        return Path(path) if self.is_dir else Path(path).parent

    def checkpoint_path(self, root: Path) -> Path:
        """The path to open (the file or the directory) for a root holding these files."""
        return Path(root) if self.is_dir else Path(root) / self.name


def merge_ranges(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Ranges sorted by file and offset, overlapping or touching ones joined, empty ones dropped."""
    out: list[tuple[str, int, int]] = []
    for rel, offset, length in sorted(r for r in ranges if r[2] > 0):
        if out and out[-1][0] == rel and offset <= out[-1][1] + out[-1][2]:
            prev_rel, prev_offset, prev_length = out[-1]
            out[-1] = (rel, prev_offset, max(prev_offset + prev_length, offset + length) - prev_offset)
        else:
            out.append((rel, offset, length))
    return out


def stage_needs(name: str, spec: StageSpec, names: set[str]) -> bool:
    """Whether a stage built for `spec` may read the canonical tensor `name` (`names`: all of the
    checkpoint's). Anything that is neither a layer's tensor nor one of the three top-level
    weights (GGUF's RoPE tables, which the config is read from) is needed by every stage."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return spec.start <= int(parts[1]) < spec.end
    if name == "embed_tokens.weight":  # a tied LM head is the embedding matrix (model/stage.py)
        return spec.first or (spec.last and "lm_head.weight" not in names)
    if name in ("lm_head.weight", "norm.weight"):
        return spec.last
    return True


class Checkpoint(ABC):
    path: Path
    config: ModelConfig

    @abstractmethod
    def names(self) -> set[str]:
        """Canonical names of the tensors this checkpoint holds."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """Canonical (torch) shape of one tensor, without reading its data."""

    @abstractmethod
    def load(self, name: str, dtype: Optional["torch.dtype"] = None) -> torch.Tensor:
        """One tensor in canonical layout on the CPU, dequantized to float32 and converted to
        `dtype`; dtype None keeps a float tensor's stored type (formats that store one).
        Implementations default dtype to torch.float32."""

    def load_packed(self, name: str):
        """(GGML type, rows (N, row_bytes) uint8, canonical shape) for formats that store
        quantized blocks (GGUF); None for formats that store plain floats."""
        return None

    def stored_type(self, name: str):
        """The GGML type a tensor is stored in (GGUF), without reading it; None for formats that
        store plain floats."""
        return None

    def stage_ranges(self, spec: StageSpec) -> StageBytes:
        """The files of this checkpoint and the byte ranges of them that `spec`'s stage reads:
        every preamble (headers, metadata, tensor directory) and the data of each tensor the
        stage needs (stage_needs). Used to copy just a stage's bytes to another node."""
        raise CheckpointError(f"{self.path.name}: {type(self).__name__} cannot say which bytes a stage "
                              "needs, so its stages cannot be copied to other nodes")

    def close(self) -> None:  # pragma: no cover - formats that hold files override it
        pass


def check_config_against_tensors(ckpt: Checkpoint) -> None:
    """Refuse a config the tensors in the file do not bear out.

    The config's sizes drive allocations before any tensor is read (the stage's modules, its
    RoPE table, its KV cache), so a header that claims 2^40 layers or a 2^40-wide hidden size
    must fail here, in one line, not as a hang or a failed allocation. The shapes come from the
    tensor directory, which each format has already checked against the bytes in the file.
    """
    cfg, names = ckpt.config, ckpt.names()
    layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.") and n.split(".")[1].isdigit()}
    if len(layers) != cfg.num_layers or (layers and max(layers) != cfg.num_layers - 1):  # no range(claim)
        held = f"layers {min(layers)}..{max(layers)}" if layers else "no layers"
        raise CheckpointError(f"{ckpt.path.name}: the config says {cfg.num_layers} layers, the file holds "
                              f"tensors for {held} ({len(layers)} distinct)")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    want = {"embed_tokens.weight": ((cfg.vocab_size, cfg.hidden_size), "vocab_size x hidden_size"),
            "layers.0.self_attn.q_proj.weight": ((q, cfg.hidden_size), "num_heads x head_dim, hidden_size"),
            "layers.0.self_attn.k_proj.weight": ((kv, cfg.hidden_size), "num_kv_heads x head_dim, hidden_size"),
            "layers.0.mlp.gate_proj.weight": ((cfg.intermediate_size, cfg.hidden_size),
                                              "intermediate_size, hidden_size")}
    if cfg.mla is not None:  # latent attention: the latent's projections instead of q/k (model/mla.py)
        m = cfg.mla
        del want["layers.0.self_attn.q_proj.weight"], want["layers.0.self_attn.k_proj.weight"]
        want["layers.0.self_attn.kv_a_proj_with_mqa.weight"] = ((m.latent_dim, cfg.hidden_size),
                                                                "kv_lora_rank + qk_rope_head_dim, hidden_size")
        want["layers.0.self_attn.kv_b_proj.weight"] = ((cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                                        m.kv_lora_rank),
                                                       "num_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank")
    if "layers.0.mlp.gate_proj.weight" not in names and "layers.0.mlp.gate.weight" in names:
        del want["layers.0.mlp.gate_proj.weight"]  # a sparse first layer: its experts have their own size
    for name, (shape, what) in want.items():
        if name not in names:
            raise CheckpointError(f"{ckpt.path.name}: tensor {name!r} is missing from the checkpoint")
        if tuple(ckpt.shape(name)) != shape:
            raise CheckpointError(f"{ckpt.path.name}: tensor {name!r} has shape {tuple(ckpt.shape(name))}, "
                                  f"the config's {what} is {shape}")


def check_attention_group(ckpt: Checkpoint, max_group: Optional[int]) -> None:
    """Refuse, before any weight is read, a model with more query heads per KV head than the
    attention its stage will run takes (`max_group`; None: no limit). The native CPU attention
    (SP_MAX_GROUP in kernels/native/ggml_matmul.h, native.MAX_GROUP) keeps a row's scores for one KV head's whole group of
    query heads together; a wider group (a multi-query model with 65+ heads) would load and then
    fail every forward. Refused rather than sent to the torch attention: that one is not batch
    invariant (model/attention.py attend_torch), so CPU decoding would no longer be lossless."""
    cfg = ckpt.config
    group = cfg.num_heads // max(cfg.num_kv_heads, 1)
    if cfg.mla is not None:  # its heads go to the attention max_group at a time (model/mla.attend_latent)
        return
    if max_group is not None and group > max_group:
        raise CheckpointError(
            f"{ckpt.path.name}: {cfg.num_heads} query heads over {cfg.num_kv_heads} KV heads is {group} query "
            f"heads per KV head, and SpecPipe's native CPU attention takes at most {max_group} per KV head; "
            "this model cannot run on the CPU (on a GPU, --device cuda, the torch attention has no such limit)")
