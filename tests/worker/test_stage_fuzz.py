"""Fuzzing a live pair of stages (issue 57, what a stage accepts): near-valid, mutated and random
Control and Rows, as objects and as wire values, over many steps (trees grow, are pruned and
committed, so that the mutations meet real state). Every step is either served or refused with
a named error (ControlRefused, RowsRefused, WireError and its RowsMalformed), none takes more than
a few seconds, the process's memory stays within 10% of its start, and a real request decodes the
same tokens after the fuzzing as before it.

The time spent fuzzing is SPECPIPE_FUZZ_SECONDS (30 by default); the seed SPECPIPE_FUZZ_SEED."""

from __future__ import annotations

import os
import random
import signal
import time

import torch

from specpipe.distributed.wire import (WireError, decode_control, decode_rows_header, encode_control, encode_rows)
from specpipe.kv.slot_table import ControlRefused, RowsRefused
from specpipe.messages import NO_PARENT, Admit, Control, Prune, Rows, Share
from specpipe.sampling import SamplingParams
from specpipe.worker.memory import process_memory
from worker_helpers import GREEDY, decode, stages  # noqa: F401 (a fixture)

SECONDS = float(os.environ.get("SPECPIPE_FUZZ_SECONDS", "30"))
STEP_LIMIT_S = 10.0  # one step of the tiny model takes milliseconds: longer is a hang
NAMED = (ControlRefused, RowsRefused, WireError)


class Fuzzer:
    """Random steps built around what the stages hold now, so that many come close to valid."""

    def __init__(self, rng: random.Random, first, last) -> None:
        self.rng, self.first, self.last = rng, first, last
        self.vocab, self.hidden = first.limits.vocab_size, first.limits.hidden
        self.next_id = 10**7  # fresh node and request ids

    def some_id(self, w) -> int:
        r = self.rng
        held = [n for q in w.slots.requests.values() for n in q.spec] + \
               [q.tip for q in w.slots.requests.values() if q.tip is not None]
        return r.choice([NO_PARENT, r.randrange(-5, 40), r.randrange(-2**62, 2**62)] + (held and [r.choice(held)]))

    def rid(self, w) -> int:
        return self.rng.choice([1, 2, 3, self.rng.randrange(-3, 2**40)] + list(w.slots.requests))

    def ids(self, w, n: int) -> list[int]:
        return [self.some_id(w) for _ in range(n)]

    def control(self, w) -> Control:
        r, c = self.rng, Control()
        kind = r.randrange(7)
        if kind == 0:
            c.admit = [Admit(self.rid(w), GREEDY, r.choice([[], self.ids(w, r.randrange(3)), list(w.slots.cached)]))
                       for _ in range(r.randrange(1, 3))]
        elif kind == 1:
            c.prune = [Prune(self.rid(w), self.ids(w, r.randrange(4)), self.ids(w, r.randrange(4)))]
        elif kind == 2:
            c.release = [self.rid(w) for _ in range(r.randrange(1, 3))]
        elif kind == 3:
            n = r.randrange(1, 3)
            c.share = [Share(self.rid(w), [r.randrange(-2, 6) for _ in range(n)], [r.randrange(50) for _ in range(n)])]
            c.release = c.release if r.random() < 0.5 else [c.share[0].request_id]
        elif kind == 4:
            c.evict = [r.choice([r.randrange(50)] + list(w.slots.cached)) for _ in range(r.randrange(1, 3))]
        elif kind == 5:
            c.prune = [Prune(self.rid(w), list(range(1000, 1000 + r.choice([10, w.slots.num_slots + 1]))))]
        return c

    def rows(self, w) -> Rows:
        r = self.rng
        t = r.randrange(0, 6)
        nodes = self.ids(w, t) if r.random() < 0.5 else [r.randrange(100, 10**6) for _ in range(t)]
        parents = [r.choice([self.some_id(w)] + nodes[:i] + nodes[i:]) for i in range(t)]
        positions = [r.choice([i, r.randrange(0, 64), r.randrange(-2**40, 2**40)]) for i in range(t)]
        if r.random() < 0.1:
            parents = parents[:-1]
        shape = r.choice([(t,), (t, self.hidden), (t, self.hidden + 1), (t + 1, self.hidden)])
        if len(shape) == 1:
            data = torch.randint(-2, self.vocab + 2, shape)
            data.clamp_(min=0) if r.random() < 0.7 else None
            data.clamp_(max=self.vocab - 1) if r.random() < 0.7 else None
        else:
            data = torch.randn(shape, dtype=r.choice([torch.float32, torch.float32, torch.bfloat16]))
        heads = r.choice([None, [], [r.randrange(-1, t + 1) for _ in range(r.randrange(3))]])
        rows = Rows(self.rid(w), nodes, parents, positions, data, heads)
        if r.random() < 0.3:
            n = t if heads is None else len(heads)
            rows.masks = torch.full((r.choice([n, n + 1]), r.choice([w.limits.mask_words, w.limits.mask_words + 1, 1])),
                                    -1, dtype=torch.long)
        return rows

    # -- near-valid steps: the trees grow deep, so that the mutations meet real state --------------
    def valid_rows(self, w) -> Rows | None:
        """Rows that obey the tree's rule for a request the stage holds, or None if it holds none."""
        r = self.rng
        live = [(rid, q) for rid, q in w.slots.requests.items() if not q.failed]
        if not live:
            return None
        rid, q = r.choice(live)
        known = {n: v[2] for n, v in q.spec.items()}
        if q.tip is not None:
            known[q.tip] = q.held - 1
        nodes, parents, positions = [], [], []
        for _ in range(r.randrange(1, 5)):
            p = r.choice(list(known))
            nodes.append(self.next_id)
            parents.append(p)
            positions.append(known[p] + 1)
            known[self.next_id] = known[p] + 1
            self.next_id += 1
        t = len(nodes)
        data = torch.randint(0, self.vocab, (t,)) if w.limits.first else torch.randn(t, self.hidden)
        heads = r.choice([None, [t - 1]])
        rows = Rows(rid, nodes, parents, positions, data, heads)
        if r.random() < 0.3:
            rows.masks = torch.full((t if heads is None else 1, w.limits.mask_words), -1, dtype=torch.long)
        return rows

    def valid_control(self, w) -> Control:
        """Admit a request, or commit a child of a request's tip (pruning its siblings), or release one."""
        r = self.rng
        live = {rid: q for rid, q in w.slots.requests.items() if not q.failed}
        kind = r.randrange(4)
        if kind == 0 or not live:
            rid = self.next_id
            self.next_id += 1
            return Control(admit=[Admit(rid, GREEDY)])
        rid, q = r.choice(list(live.items()))
        if kind == 3:
            return Control(release=[rid])
        children = [n for n, v in q.spec.items() if v[1] == q.tip]
        if not children:
            return Control()
        keep = r.choice(children)
        return Control(prune=[Prune(rid, [keep], [n for n in children if n != keep])])

    def mutate_rows(self, rows: Rows, w) -> Rows:
        r, t = self.rng, len(rows)
        i = r.randrange(t)
        op = r.randrange(7)
        if op == 0:
            rows.parent_ids[i] = self.some_id(w)
        elif op == 1:
            rows.positions[i] += r.choice([-1, 1, 2**40, -2**40])
        elif op == 2:
            rows.node_ids[i] = r.choice([self.some_id(w)] + rows.parent_ids)
        elif op == 3:
            rows.data = torch.randn(t, self.hidden + 1) if r.random() < 0.5 else torch.randint(0, self.vocab, (t,))
        elif op == 4:
            rows.masks = torch.zeros(t if rows.head_rows is None else len(rows.head_rows),
                                     r.choice([1, w.limits.mask_words + 1, 4 * w.limits.mask_words]), dtype=torch.long)
        elif op == 5:
            rows.head_rows = [i, i]
        else:
            rows.parent_ids[i] = rows.node_ids[-1]  # a parent later in the message, or itself
        return rows

    def step(self, w) -> tuple[Control, list[Rows]]:
        """A near-valid step (40%), one with a mutated Rows (40%), or a random one (20%)."""
        r, kind = self.rng, self.rng.random()
        if kind < 0.8:
            rows = self.valid_rows(w)
            if rows is not None and kind >= 0.4:
                rows = self.mutate_rows(rows, w)
            return self.valid_control(w) if r.random() < 0.5 else Control(), [] if rows is None else [rows]
        return (self.control(w) if r.random() < 0.6 else Control()), [self.rows(w) for _ in range(r.randrange(0, 3))]

    def mutate_values(self, values: list[int]) -> list[int]:
        r, values = self.rng, list(values)
        for _ in range(r.randrange(1, 4)):
            if not values:
                break
            i = r.randrange(len(values))
            op = r.randrange(4)
            if op == 0:
                values[i] = r.choice([-1, 0, 1, 2, 2**62, -2**62, r.randrange(-100, 100)])
            elif op == 1:
                del values[i:]
            elif op == 2:
                values.insert(i, r.randrange(-3, 70))
            else:
                values[i] += r.choice([-1, 1])
        return values


def through_wire(f: Fuzzer, w, control: Control, rows: list[Rows]) -> tuple[Control, list[Rows]]:
    """The step as the stage process receives it: decoded from (mutated) wire values, with the
    stage's limits; the tensors filled from what was sent where the header still matches them."""
    values = encode_control(control)
    control = decode_control(f.mutate_values(values) if f.rng.random() < 0.5 else values)
    header, tensors = encode_rows(rows)
    if f.rng.random() < 0.5:
        header = f.mutate_values(header)
    out, sent = [], iter(tensors)
    for got, shape, dtype in decode_rows_header(header, limits=w.limits):
        if shape is not None:
            data = next(sent, None)
            got.data = data if data is not None and tuple(data.shape) == shape and data.dtype == dtype \
                else torch.zeros(shape, dtype=dtype)
            if got.masks is not None:
                got.masks = torch.zeros(got.masks.shape, dtype=torch.long)
        out.append(got)
    return control, out


def _hang(signum, frame):
    raise TimeoutError(f"a fuzzed step took over {STEP_LIMIT_S} s")


def test_fuzzed_steps_are_served_or_refused_by_name(stages):
    first, last = stages()
    want = decode(first, last, rid=0, steps=6)
    rng = random.Random(int(os.environ.get("SPECPIPE_FUZZ_SEED", "57")))
    f = Fuzzer(rng, first, last)
    start_rss = process_memory()[0]
    old = signal.signal(signal.SIGALRM, _hang)
    served = refused = 0
    hidden: list[Rows] = []  # what the first stage passed on last, for the second stage
    deadline = time.monotonic() + SECONDS
    try:
        while time.monotonic() < deadline:
            w = rng.choice([first, last])
            control, rows = f.step(w)
            if w is last and hidden and rng.random() < 0.3:
                rows = hidden
            signal.setitimer(signal.ITIMER_REAL, STEP_LIMIT_S)
            try:
                if rng.random() < 0.25:
                    control, rows = through_wire(f, w, control, rows)
                out = w.step(control, rows)
                served += 1
                if w is first:
                    hidden = [o for o in out if isinstance(o, Rows)]
            except NAMED as e:
                refused += 1
                assert str(e) and type(e).__name__ in ("ControlRefused", "RowsRefused", "WireError", "RowsMalformed")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert served > 50 and refused > 50, (served, refused)
    for w in (first, last):  # let go of whatever the fuzzing left (a valid Control)
        t = w.slots
        gone = list(t.requests)
        w.step(Control(release=gone), [])
        w.step(Control(evict=list(t.cached) + list(t.lost)), [])
        assert not t.requests and t.blocks_in_use() == 0 and t.pool.num_free() == t.num_blocks
    assert process_memory()[0] <= 1.10 * start_rss, (process_memory()[0], start_rss)
    assert decode(first, last, rid=0, steps=6) == want
