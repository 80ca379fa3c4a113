"""Build the speculative token source named on the command line.

  ngram          prompt lookup, no model
  self:K         the target's first K layers plus its final norm and LM head (early exit)
  PATH           a draft model (GGUF file or Hugging Face directory) with the target's tokenizer
  A+B[+C...]     several of these merged into one layer

draft_vocab N (--draft-vocab): every draft model proposes from about N tokens only
(Tokenizer.frequent_ids). draft_quantization int8 | int4 (--draft-quantization): every draft
model's weights become Q8_0 / Q4_0 blocks at load wherever the file stores them in more bits per
weight (model/stage.py). A draft only proposes, so either changes how often the tree hits and what
a draft forward costs, never the output.
"""

from __future__ import annotations

from typing import Optional

import torch

from specpipe.config import ConfigError, StageSpec
from specpipe.tokenizer.tokenizer import Tokenizer
from specpipe.loader import Checkpoint, open_checkpoint
from specpipe.model.stage import build_stage
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import MergedSource, NgramSource, TokenSource


def build_source(spec: str, target: Checkpoint, tokenizer: Tokenizer, num_blocks: int, block_size: int,
                 device: str = "cpu", dtype: Optional[torch.dtype] = torch.float32,
                 quantization: Optional[str] = None, draft_vocab: Optional[int] = None,
                 draft_quantization: Optional[str] = None) -> TokenSource:
    """A model source gets a KV pool of `num_blocks` x `block_size` slots: a stage's pool plus
    room for the layers it drafts ahead (Engine.draft_blocks), since it holds the same committed
    tokens and tree nodes of every request and those besides."""
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    if not parts:
        raise ConfigError("--draft is empty")
    for option, value in (("--draft-vocab", draft_vocab), ("--draft-quantization", draft_quantization)):
        if value is not None and all(p == "ngram" for p in parts):
            raise ConfigError(f"{option} applies to a draft model (PATH or self:K); --draft {spec} has none")
    vocab = None if draft_vocab is None else torch.tensor(tokenizer.frequent_ids(draft_vocab))
    requantize = draft_quantization is not None
    quantization = draft_quantization if requantize else quantization
    sources = [_one(p, target, tokenizer, (num_blocks, block_size), device, dtype, quantization, requantize, vocab)
               for p in parts]
    return sources[0] if len(sources) == 1 else MergedSource(sources)


def _one(part: str, target: Checkpoint, tokenizer: Tokenizer, pool: tuple[int, int], device, dtype,
         quantization: Optional[str] = None, requantize: bool = False,
         vocab: Optional[torch.Tensor] = None) -> TokenSource:
    if part == "ngram":
        return NgramSource()
    if part.startswith("self:"):
        try:
            k = int(part[len("self:"):])
        except ValueError:
            raise ConfigError(f"--draft {part}: K must be an integer number of layers") from None
        n = target.config.num_layers
        if not 1 <= k < n:
            raise ConfigError(f"--draft self:K needs 1 <= K < {n} (the target's layer count), got {k}")
        model = build_stage(target, StageSpec(0, k, first=True, last=True), device, dtype,
                            quantization, requantize=requantize)
        return _draft_model(model, pool, f"self:{k}", tokenizer.fingerprint(), vocab)
    ckpt = open_checkpoint(part)
    draft_tok = Tokenizer.from_path(part)
    if draft_tok.fingerprint() != tokenizer.fingerprint():
        raise ConfigError(
            f"--draft {part}: its tokenizer differs from the target's; a draft model must share the "
            "target's vocabulary so that its tokens mean the same thing")
    if ckpt.config.vocab_size != target.config.vocab_size:
        raise ConfigError(
            f"--draft {part}: vocabulary size {ckpt.config.vocab_size} differs from the target's "
            f"{target.config.vocab_size}")
    model = build_stage(ckpt, StageSpec.whole(ckpt.config), device, dtype,
                        quantization, requantize=requantize)
    return _draft_model(model, pool, part, draft_tok.fingerprint(), vocab)


def _draft_model(model, pool: tuple[int, int], name: str, fingerprint: str, vocab) -> DraftModelSource:
    try:
        return DraftModelSource(model, *pool, name, fingerprint, vocab)
    except ValueError as e:  # a head whose kernel repacked its rows cannot be cut to a vocabulary
        raise ConfigError(f"--draft {name} with --draft-vocab: {e}") from None
