"""Token masks as they travel with the rows: one int64 row per head row, bit t of the row (little
endian) set when token t is allowed. Stages pass them on untouched; the last stage applies them
to the logits before the target's token is chosen, so greedy and seeded sampling both pick from
the allowed tokens only (sampling.target_tokens sees -inf elsewhere)."""

from __future__ import annotations

import torch

_BITS = torch.arange(8, dtype=torch.uint8)


def row_words(vocab_size: int) -> int:
    """int64 words per mask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 63) // 64


def from_bytes(data: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask bytes as one mask row (padded or cut to the row's width)."""
    n = row_words(vocab_size) * 8
    data = data[:n] + bytes(max(0, n - len(data)))
    return torch.frombuffer(bytearray(data), dtype=torch.int64)


def allow_all(vocab_size: int) -> torch.Tensor:
    return torch.full((row_words(vocab_size),), -1, dtype=torch.int64)


def allowed(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, W) int64 masks -> (N, vocab_size) bool; tokens past the mask's bits are not allowed."""
    b = masks.contiguous().view(torch.uint8)  # (N, 8W), little endian: byte j holds tokens 8j..8j+7
    bits = ((b.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)  # (N, 64W)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab_size - bits.shape[1])], dim=1)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits (N, V) with every token its mask forbids set to -inf (a new tensor)."""
    keep = allowed(masks, logits.shape[-1]).to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))
