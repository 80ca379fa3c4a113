"""Token masks as they travel with the rows: one int64 row per head row, bit t of the row (little
endian) set when token t is allowed. Stages pass them on untouched; the last stage applies them
to the logits before the target's token is chosen, so greedy and seeded sampling both pick from
the allowed tokens only (sampling.target_tokens sees -inf elsewhere)."""

from __future__ import annotations

import torch

# byte value -> its 8 bits (little endian), as booleans and as additive logit masks (0 / -inf)
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
_BYTE_BIAS = torch.zeros(256, 8).masked_fill(~_BYTE_BITS, float("-inf"))


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
    bits = _BYTE_BITS[b.int()].flatten(1)  # (N, 64W)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab_size - bits.shape[1])], dim=1)


def _bias(masks: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, vocab_size): 0 where allowed, -inf elsewhere (one table lookup per mask byte)."""
    bias = _BYTE_BIAS[masks.contiguous().view(torch.uint8).int()].flatten(1)  # (N, 64W)
    if bias.shape[1] >= vocab_size:
        bias = bias[:, :vocab_size]
    else:
        bias = torch.cat([bias, bias.new_full((bias.shape[0], vocab_size - bias.shape[1]), float("-inf"))], dim=1)
    return bias.to(dtype)


def is_allowed(masks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(N,) bool: whether token tokens[i] is allowed by mask row i."""
    t = tokens.to(torch.long).cpu()
    inside = t < 64 * masks.shape[1]
    words = masks.gather(1, (t.clamp(max=64 * masks.shape[1] - 1) >> 6)[:, None]).squeeze(1)
    return inside & (((words >> (t & 63)) & 1) == 1)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    """logits (N, V) with every token its mask forbids set to -inf (a new tensor).

    `greedy`: the result is only used for its argmax; rows whose plain argmax is allowed are
    left as they are (that argmax is the masked argmax: the first maximal index overall is also
    the first allowed one), and only the others are masked, which skips most of the work."""
    if greedy:
        rows = (~is_allowed(masks, logits.argmax(dim=-1))).nonzero().flatten()
        if not len(rows):
            return logits
        out = logits.clone()
        out[rows] = out[rows] + _bias(masks[rows], logits.shape[-1], logits.dtype).to(logits.device)
        return out
    return logits + _bias(masks, logits.shape[-1], logits.dtype).to(logits.device)
