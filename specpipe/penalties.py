"""Penalties and logit biases, computed over each row's own path so that speculation keeps them.

vLLM's rules, in vLLM's order, on the target's logits of one row:

  1. logit_bias: bias[t] added to logit t;
  2. repetition_penalty r over the tokens of prompt + generated: a positive logit divided by r,
     a negative (or zero) one multiplied by r;
  3. frequency_penalty f and presence_penalty p over the generated tokens only:
     logit[t] -= f * count(t) + p * (count(t) > 0).

(min_p is a cut after temperature: sampling.target_tokens.) Greedy and seeded sampling then use
the adjusted logits; logprobs still describe the raw distribution (sampling.target_logprobs).

Why the driver ships each row's context: under speculation a row is a tree node, and its
"generated tokens" are the committed output plus the speculative tokens above it, which differ
from row to row and are known only to the driver. The last stage keeps no token history (its
rows carry activations, and prompt blocks served from the prefix cache never reach it), so each
Rows message of a penalized request carries, for its head rows:

  seen   (2, P) int64   the committed context's distinct tokens (row 0) and for each
                        count_in_generated * 2 + in_prompt (row 1); prompt tokens only when the
                        repetition penalty needs them
  paths  (H, D) int64   each head row's tokens below the committed prefix (its tree ancestors,
                        itself included), padded with -1

so a message grows with the distinct tokens of the context, not with the vocabulary, and a row's
adjustment is a function of its own path only: every mode gives plain decoding's tokens.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch

from specpipe.sampling import SamplingParams

PAD = -1  # fills `paths` past a row's own tokens


def context_tensors(prompt_len: int, committed: Sequence[int], paths: Sequence[Optional[Sequence[int]]],
                    params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The driver's side: `seen` and `paths` (see the module) for head rows whose speculative
    tokens are `paths` (None: a row no longer in the tree, whose token is never used), below the
    `committed` tokens, of which the first `prompt_len` are the prompt."""
    ctx = PenaltyContext(committed[:prompt_len], params)
    ctx.extend(committed[prompt_len:])
    return ctx.seen(), paths_tensor(paths)


class PenaltyContext:
    """One request's committed context as penalties read it, kept by the driver as tokens are
    committed, so a step costs its new tokens (and a new `seen` only when some were committed)."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self.prompt = set(prompt) if params.repetition_penalty != 1 else set()  # only it reads the prompt
        self.counts: Counter = Counter()  # generated token -> count
        self.consumed = len(prompt)  # committed tokens (prompt included) counted so far
        self._seen: Optional[torch.Tensor] = None

    def extend(self, generated: Sequence[int]) -> None:
        self.counts.update(generated)
        self.consumed += len(generated)
        self._seen = None

    def follow(self, tree) -> None:
        """Count what the request's TokenTree committed since the last call."""
        if tree.num_committed > self.consumed:
            self.extend(tree.committed_since(self.consumed))

    def seen(self) -> torch.Tensor:
        if self._seen is None:
            ids = sorted(self.counts.keys() | self.prompt)
            self._seen = torch.tensor([ids, [self.counts.get(t, 0) * 2 + (t in self.prompt) for t in ids]],
                                      dtype=torch.long).reshape(2, -1)
        return self._seen


def paths_tensor(paths: Sequence[Optional[Sequence[int]]]) -> torch.Tensor:
    """(H, D) int64: each head row's speculative tokens, PAD after them (None: none)."""
    depth = max((len(p) for p in paths if p), default=0)
    rows = [list(p or ()) + [PAD] * (depth - len(p or ())) for p in paths]
    return torch.tensor(rows, dtype=torch.long).reshape(len(paths), depth)


def adjust_logits(logits: torch.Tensor, params: SamplingParams, seen: Optional[torch.Tensor],
                  paths: Optional[torch.Tensor]) -> torch.Tensor:
    """The last stage's side: logits (H, V) of head rows, adjusted (float32, a new tensor; the
    input is returned as it is when the request asks for nothing)."""
    if not params.logit_bias and seen is None:
        return logits
    x = logits.float().clone()  # (H, V)
    h, v = x.shape
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=x.device)
        x[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=x.device)
    if seen is None:
        return x
    # Only the U tokens of the context or of some path change: work on those columns alone.
    seen, paths = seen.to(x.device), paths.to(x.device)
    ids = torch.cat([seen[0], paths[paths != PAD]]).unique()  # (U,) ascending
    if not len(ids):
        return x
    at = torch.searchsorted(ids, seen[0])  # each seen token's column among ids
    counts = torch.zeros(len(ids), dtype=torch.float32, device=x.device)
    counts[at] = (seen[1] >> 1).float()
    in_prompt = torch.zeros(len(ids), dtype=torch.bool, device=x.device)
    in_prompt[at] = (seen[1] & 1).bool()
    counts = counts.expand(h, len(ids)).clone()  # (H, U): generated tokens on each row's path
    if paths.numel():
        cols = torch.searchsorted(ids, paths).clamp(max=len(ids) - 1)  # (PAD adds 0, wherever it lands)
        counts.scatter_add_(1, cols, (paths != PAD).float())
    generated = counts > 0
    sub = x[:, ids]  # (H, U)
    if params.repetition_penalty != 1:
        r = torch.where(in_prompt | generated, params.repetition_penalty, 1.0)  # (H, U)
        sub = torch.where(sub > 0, sub / r, sub * r)
    x[:, ids] = sub - params.frequency_penalty * counts - params.presence_penalty * generated.float()
    return x
