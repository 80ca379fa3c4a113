"""One pipeline stage: apply the driver's control, drop pruned rows, compute, pass rows on.

    recv Control + Rows (one per request)  ->  prune / commit bookkeeping
        ->  one packed forward over every request's surviving rows (kv/packed_forward.py)
        ->  Rows to the next stage (or, on the last stage, each request's target tokens)

The worker is transport-agnostic: the in-process pipeline (local_pipeline.py) and the
torch.distributed stage process (stage_main.py) both drive it the same way.

When the KV pool runs out for a request, only that request fails: its KV is freed here, its later
rows are dropped, and a `Rows.failure` marker goes downstream in its place; the last stage turns
the marker into `Results(failed=True)` for the driver.

A step is checked whole before anything changes (`check`), so a refused one leaves the stage as
it was; the error says whose message was at fault (its `source`):
  ControlRefused  (KVStateError, "control")  the driver's Control contradicts the stage's state
  RowsRefused     (KVStateError, "rows")     Rows whose tree contradicts it (a parent not held...)
  RowsMalformed   (WireError, "rows")        Rows outside the stage's RowLimits (shape, type,
                                             token ids, mask width, row count)
Anything else raised by `step` is the stage's own fault.
"""

from __future__ import annotations

import collections
import time

import torch

from specpipe.messages import Control, Results, Rows, StageStats
from specpipe.model.llama import LlamaStage
from specpipe.model.stage import weight_nbytes
from specpipe.grammar.bitmask import apply_masks
from specpipe.penalties import adjust_logits
from specpipe.sampling import SamplingParams, target_logprobs, target_tokens
from specpipe.kv.packed_forward import run_packed
from specpipe.distributed.wire import RowLimits, RowsMalformed, check_rows
from specpipe.grammar.bitmask import row_words
from specpipe.kv.slot_table import MAX_HORIZON, ControlRefused, SlotTable
from specpipe.kv.step_check import StepView, check_control
from specpipe.worker.memory import process_memory


SPAN_LOG = 1 << 16  # steps of compute spans kept between two reports


class StageWorker:
    def __init__(self, model: LlamaStage, num_blocks: int, block_size: int, horizon: int = MAX_HORIZON,
                 window_blocks: int = 0) -> None:
        """`horizon`: steps rows take at most from the driver to here (the stage's index + 1), so
        the slot table knows how long a pruned node's row may still arrive.
        `window_blocks`: a pool of this many blocks for the sliding-window layers' KV, which keeps
        only what their window still needs (0: every layer in the main pool)."""
        self.model = model
        self.last = model.spec.last
        sliding = model.num_sliding if window_blocks else 0
        self.slots = SlotTable(num_blocks, block_size, horizon,
                               window_pool=(model.cfg.sliding_window, window_blocks) if sliding else None)
        self.kv = model.make_kv_cache(self.slots.num_slots, model.num_layers - sliding)
        self.window_kv = model.make_kv_cache(self.slots.window.num_slots, sliding) if sliding else None
        self.sampling: dict[int, SamplingParams] = {}
        self._admit_failed: list[int] = []  # admitted failed here this step (a lost cached block)
        kv_bytes = self.kv.nbytes() + (self.window_kv.nbytes() if sliding else 0)
        self.stats = StageStats(num_blocks=num_blocks, weight_bytes=weight_nbytes(model), kv_bytes=kv_bytes,
                                window_blocks=window_blocks if sliding else 0)
        # (step, start, end) of each step that computed rows, perf_counter_ns (CLOCK_MONOTONIC on
        # Linux: one clock for every process of a machine); drained by each report.
        self.spans: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=SPAN_LOG)
        cfg = model.cfg
        self.limits = RowLimits(first=model.spec.first, hidden=cfg.hidden_size, dtype=model.act_dtype,
                                vocab_size=cfg.vocab_size, mask_words=row_words(cfg.vocab_size),
                                max_rows=self.slots.num_slots)

    def check(self, control: Control, incoming: list[Rows]) -> list[list[int]]:
        """Refuse the step (see the module) or say which rows of each Rows this stage computes
        (those not pruned in flight, of requests still held here). Changes nothing."""
        check_control(self.slots, control)
        for a in control.admit:  # a bias past the vocabulary would index the logits out of range
            if any(t >= self.limits.vocab_size for t, _ in a.sampling.logit_bias):
                raise ControlRefused(f"request {a.request_id}: logit_bias names a token id past the "
                                     f"vocabulary of {self.limits.vocab_size}")
        if sum(len(rows) for rows in incoming) > self.limits.max_rows:
            raise RowsMalformed(f"{sum(len(rows) for rows in incoming)} rows in one step, "
                                f"at most {self.limits.max_rows} can come")
        view, keep = StepView(self.slots, control), []
        for rows in incoming:
            check_rows(rows, self.limits)
            if rows.failed:
                view.fail(rows.request_id)
                keep.append([])
            else:
                keep.append(view.rows(rows.request_id, rows.node_ids, rows.parent_ids, rows.positions))
        return keep

    def apply(self, control: Control) -> None:
        """In the driver's order: blocks joining the prefix cache, releases, evictions, admits
        (which may read what was cached just now), then each request's commits and prunings."""
        released = set(control.release)
        for sh in control.share:
            moves = self.slots.share(sh.request_id, sh.blocks, sh.ids, final=sh.request_id in released)
            if moves:
                self.kv.move(moves)
        for rid in control.release:
            self.slots.release(rid)
            self.sampling.pop(rid, None)
        self.slots.evict(control.evict)
        for a in control.admit:
            if not self.slots.admit(a.request_id, a.cached):
                self._admit_failed.append(a.request_id)
            self.sampling[a.request_id] = a.sampling
        for p in control.prune:
            if p.request_id not in self.slots.requests:
                continue
            self.slots.drop(p.request_id, p.drop)
            self.stats.rows_committed += self.slots.commit(p.request_id, p.commit)

    def step(self, control: Control, incoming: list[Rows]) -> list[Rows | Results]:
        """One pipeline step of this stage: checked whole (`check`), then applied."""
        start = time.perf_counter_ns()
        live = self.check(control, incoming)
        self.slots.tick()
        self.apply(control)
        self.stats.steps += 1
        out: list[Rows | Results] = [self._failure(rid) for rid in self._admit_failed]
        self._admit_failed = []
        parts = []
        for rows, keep in zip(incoming, live):
            r = self.slots.requests.get(rows.request_id)
            if r is None:
                continue  # released while these rows were in flight (EOS or max tokens mid-tree)
            if rows.failed:
                if not r.failed:  # pass the marker on once; later stages then drop it alone
                    self.slots.fail(rows.request_id)
                    out.append(self._failure(rows.request_id))
                continue
            rows = rows.select(keep)  # the rows pruned in flight left out (SlotTable.live_rows)
            if len(rows):
                parts.append(rows)
        if parts:
            t0 = time.perf_counter()
            packed = run_packed(self.model, self.kv, self.slots, parts, self.window_kv)
            self.stats.requests_failed += len(packed.failed)
            out += [self._failure(rid) for rid in packed.failed]
            done = [(rows, o) for rows, o in zip(parts, packed.outputs) if o is not None]
            out += self._results(done) if self.last else [
                Rows(rows.request_id, rows.node_ids, rows.parent_ids, rows.positions, o, rows.head_rows,
                     masks=rows.masks, seen=rows.seen, paths=rows.paths, scored=rows.scored)
                for rows, o in done]
            self.stats.rows_committed += packed.committed
            self.stats.rows_computed += sum(len(rows) for rows, _ in done)
            self.stats.peak_slots = max(self.stats.peak_slots, self.slots.total_in_use())
            self.stats.compute_s += time.perf_counter() - t0
            self.spans.append((self.stats.steps, start, time.perf_counter_ns()))
        self.stats.blocks_in_use = self.slots.blocks_in_use()
        if self.slots.window is not None:
            self.stats.window_blocks_in_use = self.slots.window.blocks_in_use()
        return out

    def _results(self, done: list[tuple[Rows, torch.Tensor]]) -> list[Results]:
        """The target's token for each head row, sampled per request with its own parameters (RNG
        keyed by (seed, position)). All greedy requests share one argmax: one device sync per
        step instead of one per request."""
        raw = {id(rows): logits for rows, logits in done}  # logprobs describe the raw distribution
        # logit_bias and penalties over each row's own path (penalties.py), then the grammar's
        # masks, so greedy and sampling pick allowed tokens only.
        done = [(rows, adjust_logits(logits, self.sampling[rows.request_id], rows.seen, rows.paths))
                for rows, logits in done]
        done = [(rows, logits if rows.masks is None else
                 apply_masks(logits, rows.masks, greedy=self.sampling[rows.request_id].greedy)) for rows, logits in done]
        greedy = [logits for rows, logits in done if self.sampling[rows.request_id].greedy]  # (R_i, V) each
        argmax = iter(torch.cat(greedy).argmax(dim=-1).tolist() if greedy else [])
        out = []
        for rows, logits in done:
            picked = rows.head_rows if rows.head_rows is not None else range(len(rows))
            params = self.sampling[rows.request_id]
            tokens = [next(argmax) for _ in picked] if params.greedy else \
                target_tokens(logits, [rows.positions[i] for i in picked], params)
            logprobs = None if params.logprobs is None else \
                target_logprobs(raw[id(rows)], tokens, params.logprobs)  # asked for: one per head row
            if rows.scored is not None:  # prompt logprobs: a scored row's is its next prompt token's
                # (one top count for all rows, as Results carry them: the driver trims each to its own)
                k = max(params.prompt_logprobs, params.logprobs or 0)
                logprobs = target_logprobs(raw[id(rows)], [t if s < 0 else s for s, t in zip(rows.scored, tokens)], k)
            out.append(Results(rows.request_id, [rows.node_ids[i] for i in picked], tokens, logprobs=logprobs))
        return out

    def _failure(self, request_id: int) -> Rows | Results:
        return Results(request_id, [], [], failed=True) if self.last else Rows.failure(request_id)

    def take_spans(self) -> list[tuple[int, int, int]]:
        spans = list(self.spans)
        self.spans.clear()
        return spans

    def report(self) -> dict:
        """This stage's StageStats as a dict with the spans since the last report (the in-process
        twin of the stage process's report)."""
        self.stats.rss_bytes, self.stats.peak_rss_bytes = process_memory()
        return {**self.stats.as_dict(), "spans": self.take_spans()}
