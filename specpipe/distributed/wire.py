"""Encoding of the driver/stage messages as int64 tensors: nothing pickled crosses a link.

Every message is one int64 vector (control data as plain integers; floats travel as their IEEE
bits) followed, for rows, by one activation tensor per request whose shape and dtype the vector
announces (none for a failure marker). Decoding validates lengths, so a corrupt or foreign
message is an error, not a crash.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch

from specpipe.messages import Admit, Control, Prune, Results, Rows, Share, StageStats
from specpipe.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs

DTYPES = [torch.long, torch.float32, torch.bfloat16, torch.float16]


class WireError(RuntimeError):
    """A message that does not decode: a version mismatch or a corrupted link; the sender's fault.
    `source`: "rows" when it is known to be a Rows message (see RowsMalformed), else None."""

    source: Optional[str] = None


class RowsMalformed(WireError):
    """Rows outside what the receiving stage accepts (RowLimits): token ids sent past stage 1 or
    activations into it, a width or type not the model's, token ids outside the vocabulary, masks
    not the vocabulary's width, more rows than its KV pool holds. Raised as the header is decoded,
    before anything is allocated for it, and by the stage worker for Rows handed over in-process."""

    source = "rows"


@dataclass(frozen=True)
class RowLimits:
    """What one stage accepts in a step's Rows, from its model and its KV pool."""

    first: bool  # stage 1 takes token ids (T,); every later stage activations (T, hidden)
    hidden: int  # the model's width
    dtype: torch.dtype  # the activations' type (the model's)
    vocab_size: int  # token ids are < it
    mask_words: int  # int64 words in a token mask row: the vocabulary's width (grammar/bitmask.py)
    max_rows: int  # the KV pool's slots: more rows in one step could never be placed


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _i2f(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", x))[0]


class _Reader:
    def __init__(self, values: list[int]) -> None:
        self.v, self.i = values, 0
        self.masked = False  # the last Rows flags read announced token masks
        self.penalized = False  # the last Rows flags read announced penalty contexts
        self.scored = False  # the last Rows flags read announced scored tokens
        self.logprobs = False  # the last Results flags read announced log-probabilities

    def take(self, n: int = 1) -> list[int]:
        if n < 0 or self.i + n > len(self.v):
            raise WireError("message ended early")
        out = self.v[self.i:self.i + n]
        self.i += n
        return out

    def one(self) -> int:
        return self.take()[0]

    def count(self) -> int:
        """A length or a number of entries: never negative."""
        n = self.one()
        if n < 0:
            raise WireError(f"negative count {n}")
        return n

    def done(self) -> None:
        if self.i != len(self.v):
            raise WireError(f"{len(self.v) - self.i} unexpected trailing values")


def encode_control(c: Control) -> list[int]:
    out = [int(c.shutdown) | int(c.report) << 1, len(c.admit)]
    for a in c.admit:
        s = a.sampling
        out += [a.request_id, _f2i(s.temperature), _f2i(s.top_p), s.top_k,
                -1 if s.seed is None else s.seed, s.max_tokens, -1 if s.logprobs is None else s.logprobs,
                -1 if s.prompt_logprobs is None else s.prompt_logprobs,
                _f2i(s.presence_penalty), _f2i(s.frequency_penalty), _f2i(s.repetition_penalty), _f2i(s.min_p),
                len(s.logit_bias), *(x for t, b in s.logit_bias for x in (t, _f2i(b))),
                len(a.cached), *a.cached]
    out.append(len(c.prune))
    for p in c.prune:
        out += [p.request_id, len(p.commit), *p.commit, len(p.drop), *p.drop]
    out += [len(c.release), *c.release, len(c.share)]
    for sh in c.share:
        out += [sh.request_id, len(sh.blocks), *sh.blocks, *sh.ids]
    out += [len(c.evict), *c.evict]
    return out


def decode_control(values: list[int]) -> Control:
    r = _Reader(values)
    flags = r.one()
    if flags & ~3:
        raise WireError(f"unknown control flags {flags:#x}")
    c = Control(shutdown=bool(flags & 1), report=bool(flags & 2))
    for _ in range(r.count()):
        rid, temp, top_p, top_k, seed, max_tokens, logprobs, prompt_lps, presence, frequency, repetition, min_p = r.take(12)
        bias = r.take(2 * r.count())
        try:
            sampling = SamplingParams(_i2f(temp), _i2f(top_p), top_k, None if seed == -1 else seed, max_tokens,
                                      logprobs=None if logprobs == -1 else logprobs,
                                      prompt_logprobs=None if prompt_lps == -1 else prompt_lps, presence_penalty=_i2f(presence),
                                      frequency_penalty=_i2f(frequency), repetition_penalty=_i2f(repetition),
                                      min_p=_i2f(min_p), logit_bias=tuple(zip(bias[::2], map(_i2f, bias[1::2]))))
        except ValueError as e:  # out-of-range values: not something a driver of ours sends
            raise WireError(f"bad sampling parameters for request {rid}: {e}") from None
        c.admit.append(Admit(rid, sampling, r.take(r.count())))
    for _ in range(r.count()):
        rid = r.one()
        commit = r.take(r.count())
        drop = r.take(r.count())
        c.prune.append(Prune(rid, commit, drop))
    c.release = r.take(r.count())
    for _ in range(r.count()):
        rid, n = r.one(), r.count()
        c.share.append(Share(rid, r.take(n), r.take(n)))
    c.evict = r.take(r.count())
    r.done()
    return c


FAILED = 1  # flag of a Rows or Results: the request ran out of KV at some stage (no rows)
MASKED = 2  # flag of a Rows: a second tensor follows, its head rows' token masks (int64 bits)
PENALIZED = 4  # flag of a Rows: two int64 tensors follow (after any masks), `seen` and `paths` (penalties.py)
SCORED = 8  # flag of a Rows: its header ends with one scored token per head row (Rows.scored)
LOGPROBS = 2  # flag of a Results: each row's log-probabilities follow its tokens
MAX_MASK_WORDS = 1 << 16  # int64 words per mask row without RowLimits: vocabularies up to 4M tokens


def _flags(values: _Reader, what: str) -> bool:
    """The flags value of a Rows or Results entry: True when it is a failure marker."""
    flags = values.one()
    if flags & ~(FAILED | (MASKED | PENALIZED | SCORED if what == "rows" else LOGPROBS)):
        raise WireError(f"unknown {what} flags {flags:#x}")
    values.masked = bool(flags & MASKED) if what == "rows" else False
    values.penalized = bool(flags & PENALIZED) if what == "rows" else False
    values.scored = bool(flags & SCORED) if what == "rows" else False
    values.logprobs = bool(flags & LOGPROBS) if what == "results" else False
    return bool(flags & FAILED)


def encode_rows(batch: list[Rows]) -> tuple[list[int], list[torch.Tensor]]:
    """Header values plus the activation tensors that follow it, one per Rows that is not a
    failure marker (a marker carries nothing but its request id)."""
    out, tensors = [len(batch)], []
    for rows in batch:
        if rows.failed:
            out += [rows.request_id, FAILED]
            continue
        t = len(rows)
        heads = rows.head_rows
        data = rows.data.contiguous()
        masks = rows.masks
        penalized = rows.seen is not None
        flags = (0 if masks is None else MASKED) | (PENALIZED if penalized else 0) | (0 if rows.scored is None else SCORED)
        out += [rows.request_id, flags, t,
                -1 if heads is None else len(heads),
                *(heads or []), *rows.node_ids, *rows.parent_ids, *rows.positions,
                DTYPES.index(data.dtype), data.dim(), *data.shape]
        tensors.append(data)
        if masks is not None:
            out += list(masks.shape)
            tensors.append(masks.to(torch.long).contiguous())
        if penalized:
            out += [*rows.seen.shape, *rows.paths.shape]
            tensors += [rows.seen.to(torch.long).contiguous(), rows.paths.to(torch.long).contiguous()]
        if rows.scored is not None:
            out += list(rows.scored)
    return out, tensors


def decode_rows_header(values: list[int], hidden: Optional[int] = None, max_rows: Optional[int] = None,
                       limits: Optional[RowLimits] = None
                       ) -> list[tuple[Rows, Optional[tuple[int, ...]], Optional[torch.dtype]]]:
    """The Rows (data still empty) with the shape and dtype of the tensor to receive for each;
    (marker, None, None) for a failure marker, which has no tensor. Rows that carry token masks
    come with `masks` an empty int64 tensor of the shape to receive next (after the activations).
    `limits`: the receiving stage's (StageWorker.limits): rows it would refuse raise
    RowsMalformed before anything is allocated for them. Without them only `hidden` and
    `max_rows` are checked (the model's width, the most rows a step brings)."""
    if limits is not None:
        hidden, max_rows = limits.hidden, limits.max_rows
    r = _Reader(values)
    rows_in_all = 0
    out = []
    for _ in range(r.count()):
        rid = r.one()
        if _flags(r, "rows"):
            out.append((Rows.failure(rid), None, None))
            continue
        t, n_heads = r.count(), r.one()
        if max_rows is not None and rows_in_all + t > max_rows:
            raise RowsMalformed(f"{rows_in_all + t} rows in one step, at most {max_rows} can come")
        rows_in_all += t
        if n_heads < -1:
            raise WireError(f"bad head-row count {n_heads}")
        heads = None if n_heads == -1 else r.take(n_heads)
        node_ids, parent_ids, positions = r.take(t), r.take(t), r.take(t)
        dtype_code, ndim = r.take(2)
        if not 0 <= dtype_code < len(DTYPES) or ndim not in (1, 2):
            raise WireError(f"bad activation descriptor ({dtype_code}, {ndim})")
        shape = tuple(r.take(ndim))
        mask_shape = tuple(r.take(2)) if r.masked else None
        seen_shape, paths_shape = (tuple(r.take(2)), tuple(r.take(2))) if r.penalized else (None, None)
        check_rows_shape(rid, t, heads, shape, DTYPES[dtype_code], mask_shape, limits)
        if r.penalized:
            check_penalty_shapes(rid, seen_shape, paths_shape, t if heads is None else len(heads),
                                 limits.vocab_size if limits is not None else MAX_MASK_WORDS * 64)
        if limits is None:
            if hidden is not None and ndim == 2 and shape[1] != hidden:
                raise RowsMalformed(f"activation of width {shape[1]}, the model's hidden size is {hidden}")
            if hidden is not None and ndim == 1 and DTYPES[dtype_code] != torch.long:
                raise RowsMalformed(f"1-D activation of type {DTYPES[dtype_code]} (only token ids are 1-D)")
            if mask_shape is not None and not 0 < mask_shape[1] <= MAX_MASK_WORDS:
                raise RowsMalformed(f"bad token masks {mask_shape} for request {rid}")
        masks = None if mask_shape is None else torch.empty(mask_shape, dtype=torch.long)
        n_scored = t if heads is None else len(heads)
        scored = r.take(n_scored) if r.scored else None
        if scored is not None and any(s < -1 for s in scored):
            raise RowsMalformed(f"request {rid}: a scored token id below -1")
        if scored is not None and limits is not None and any(s >= limits.vocab_size for s in scored):
            raise RowsMalformed(f"request {rid}: a scored token id outside the vocabulary of {limits.vocab_size}")
        rows = Rows(rid, node_ids, parent_ids, positions, torch.empty(0), heads, masks=masks, scored=scored)
        if r.penalized:  # received after the masks, as `masks` is
            rows.seen, rows.paths = torch.empty(seen_shape, dtype=torch.long), torch.empty(paths_shape, dtype=torch.long)
        out.append((rows, shape, DTYPES[dtype_code]))
    r.done()
    return out


def check_rows_shape(rid: int, t: int, heads: Optional[list[int]], shape: tuple[int, ...], dtype: torch.dtype,
                     mask_shape: Optional[tuple[int, ...]], limits: Optional[RowLimits]) -> None:
    """One Rows entry's shapes against what the stage accepts (RowsMalformed): the header's as it
    is decoded (nothing allocated yet), or an in-process Rows' tensors (StageWorker)."""
    if any(d < 0 for d in shape) or shape[0] != t:
        raise RowsMalformed(f"request {rid}: activation of shape {shape} for {t} rows")
    if heads is not None and (len(set(heads)) != len(heads) or any(not 0 <= h < t for h in heads)):
        raise RowsMalformed(f"request {rid}: head rows {heads} are not distinct rows of {t}")
    n_heads = t if heads is None else len(heads)
    if mask_shape is not None and (len(mask_shape) != 2 or mask_shape[0] != n_heads):
        raise RowsMalformed(f"request {rid}: token masks of shape {mask_shape} for {n_heads} head rows")
    if limits is None:
        return
    if limits.first and (len(shape) != 1 or dtype != torch.long):
        raise RowsMalformed(f"request {rid}: stage 1 takes token ids (T,) int64, got {tuple(shape)} {dtype}")
    if not limits.first and (len(shape) != 2 or shape[1] != limits.hidden or dtype != limits.dtype):
        raise RowsMalformed(f"request {rid}: this stage takes activations ({t}, {limits.hidden}) {limits.dtype}, "
                            f"got {tuple(shape)} {dtype}" + (" (token ids go to stage 1 only)" if len(shape) == 1 else ""))
    if mask_shape is not None and mask_shape[1] != limits.mask_words:
        raise RowsMalformed(f"request {rid}: token masks of {mask_shape[1]} words a row, the vocabulary of "
                            f"{limits.vocab_size} tokens takes {limits.mask_words}")


def check_penalty_shapes(rid: int, seen: tuple[int, ...], paths: tuple[int, ...], n_heads: int, vocab: int) -> None:
    """A Rows' penalty context (penalties.py): `seen` (2, P) with P at most the vocabulary,
    `paths` (H, D) for its H head rows, D at most the context a step can add (RowsMalformed)."""
    if len(seen) != 2 or seen[0] != 2 or not 0 <= seen[1] <= vocab:
        raise RowsMalformed(f"request {rid}: penalty context of shape {seen} (2 rows of at most {vocab} tokens)")
    if len(paths) != 2 or paths[0] != n_heads or not 0 <= paths[1] <= MAX_PATH:
        raise RowsMalformed(f"request {rid}: penalty paths of shape {paths} for {n_heads} head rows")


MAX_PATH = 1 << 16  # speculative tokens on one row's path (a tree is far shallower)


def check_rows(rows: Rows, limits: RowLimits) -> None:
    """A Rows handed over in-process (no header was decoded) against what the stage accepts, and
    stage 1's token ids against the vocabulary (an id past it would index the embedding out of
    range deep inside the model): RowsMalformed."""
    if rows.failed:
        return
    t, data = len(rows.node_ids), rows.data
    if len(rows.parent_ids) != t or len(rows.positions) != t:
        raise RowsMalformed(f"request {rows.request_id}: {t} rows with {len(rows.parent_ids)} parents and "
                            f"{len(rows.positions)} positions")
    if rows.masks is not None and rows.masks.dtype != torch.long:
        raise RowsMalformed(f"request {rows.request_id}: token masks of type {rows.masks.dtype}, not int64")
    check_rows_shape(rows.request_id, t, rows.head_rows, tuple(data.shape), data.dtype,
                     None if rows.masks is None else tuple(rows.masks.shape), limits)
    if limits.first and t and not 0 <= int(data.min()) <= int(data.max()) < limits.vocab_size:
        raise RowsMalformed(f"request {rows.request_id}: token ids outside the vocabulary of {limits.vocab_size}")
    n_heads = t if rows.head_rows is None else len(rows.head_rows)
    if rows.scored is not None and (len(rows.scored) != n_heads or any(not -1 <= s < limits.vocab_size for s in rows.scored)):
        raise RowsMalformed(f"request {rows.request_id}: scored tokens {rows.scored[:8]} for {n_heads} head rows")
    if (rows.seen is None) != (rows.paths is None):
        raise RowsMalformed(f"request {rows.request_id}: a penalty context needs both `seen` and `paths`")
    if rows.seen is not None:
        seen, paths = rows.seen, rows.paths
        if seen.dtype != torch.long or paths.dtype != torch.long:
            raise RowsMalformed(f"request {rows.request_id}: penalty context of type {seen.dtype}, {paths.dtype}, not int64")
        check_penalty_shapes(rows.request_id, tuple(seen.shape), tuple(paths.shape),
                             t if rows.head_rows is None else len(rows.head_rows), limits.vocab_size)
        v = limits.vocab_size
        if seen.numel() and not (0 <= int(seen[0].min()) and int(seen[0].max()) < v and int(seen[1].min()) >= 0):
            raise RowsMalformed(f"request {rows.request_id}: penalty context outside the vocabulary of {v}")
        if paths.numel() and not -1 <= int(paths.min()) <= int(paths.max()) < v:
            raise RowsMalformed(f"request {rows.request_id}: penalty paths outside the vocabulary of {v}")


def encode_results(results: list[Results]) -> list[int]:
    """[n, then per result: request id, flags, N, node ids (N), tokens (N), and with LOGPROBS:
    k, then per row its logprob, k top ids, k top logprobs (floats as their bits)]."""
    out = [len(results)]
    for res in results:
        if res.failed and res.node_ids:
            raise ValueError(f"request {res.request_id}: a failed result carries no tokens")
        lps = res.logprobs
        flags = (FAILED if res.failed else 0) | (LOGPROBS if lps is not None else 0)
        out += [res.request_id, flags, len(res.node_ids), *res.node_ids, *res.tokens]
        if lps is not None:
            if len(lps) != len(res.node_ids) or len({len(t.top_ids) for t in lps}) > 1:
                raise ValueError(f"request {res.request_id}: logprobs for {len(lps)} of {len(res.node_ids)} rows, "
                                 f"or rows with different top counts")
            out.append(len(lps[0].top_ids) if lps else 0)
            for t in lps:
                out += [_f2i(t.logprob), *t.top_ids, *(_f2i(v) for v in t.top_logprobs)]
    return out


def decode_results(values: list[int]) -> list[Results]:
    r = _Reader(values)
    out = []
    for _ in range(r.count()):
        rid = r.one()
        failed = _flags(r, "results")
        n = r.count()
        if failed and n:
            raise WireError(f"request {rid}: a failed result with {n} tokens")
        res = Results(rid, r.take(n), r.take(n), failed)
        if r.logprobs:
            k = r.count()
            if k > MAX_LOGPROBS:
                raise WireError(f"request {rid}: {k} top logprobs a row, at most {MAX_LOGPROBS}")
            res.logprobs = []
            for _ in range(n):
                lp, ids, top = r.one(), r.take(k), r.take(k)
                res.logprobs.append(TokenLogprobs(_i2f(lp), tuple(ids), tuple(_i2f(v) for v in top)))
        out.append(res)
    r.done()
    return out


def encode_floats(values: list[float]) -> list[int]:
    return [_f2i(float(v)) for v in values]


def decode_floats(values: list[int]) -> list[float]:
    return [_i2f(v) for v in values]


def encode_report(stats: StageStats, spans: list[tuple[int, int, int]] = ()) -> list[int]:
    """The stage's counters (floats) and its compute spans since the last report:
    [counters..., n, step_1, start_1, end_1, ..., step_n, start_n, end_n] (times in ns)."""
    return encode_floats(stats.values()) + [len(spans)] + [v for span in spans for v in span]


def decode_report(values: list[int]) -> dict:
    """A stage's report as `StageStats.as_dict()` plus "spans": [(step, start_ns, end_ns)]."""
    n = len(StageStats().values())
    r = _Reader(values[n:])
    try:
        report = StageStats.from_values(decode_floats(values[:n]))
        flat = r.take(3 * r.count())
        r.done()
    except (ValueError, WireError) as e:  # a stage of another version
        raise WireError(str(e)) from None
    report["spans"] = [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]
    return report
