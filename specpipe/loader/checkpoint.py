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
The model's parameter names are these names, so loading is a checked copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from specpipe.config import ModelConfig

if TYPE_CHECKING:  # only annotations need torch: the tokenizer imports this package without it
    import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is meant for the user."""


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

    def close(self) -> None:  # pragma: no cover - formats that hold files override it
        pass
