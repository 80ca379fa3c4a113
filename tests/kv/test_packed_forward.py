"""One packed forward over several requests gives what each request computes alone.

The packed side puts every request in one slot table and one KV cache and computes each step's
rows of all requests in a single forward; the reference computes each request in its own table
and cache. Mixed segments: a prefill chain, a tree layer under a committed prefix (with a mask),
and a single decode row.
"""

from __future__ import annotations

import pytest
import torch

from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.messages import NO_PARENT, Rows
from specpipe.model.stage import build_stage
from specpipe.kv.packed_forward import run_packed
from specpipe.kv.slot_table import SlotTable

BLOCK = 4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chain(rid: int, toks: list[int], start: int, head_rows=None) -> Rows:
    """Rows of a plain sequence at positions start.. (node id = position)."""
    ids = list(range(start, start + len(toks)))
    return Rows(rid, ids, [start - 1 if start else NO_PARENT] + ids[:-1], ids, torch.tensor(toks), head_rows)


def tree_layer(rid: int, prefix: int) -> Rows:
    """Two layers of a small tree under the last committed node (prefix - 1), depth-first order so
    that rows are not sorted by depth: 100 -> {101 -> 103, 102}."""
    parents = {100: prefix - 1, 101: 100, 103: 101, 102: 100}
    depth = {100: 0, 101: 1, 103: 2, 102: 1}
    order = [100, 101, 103, 102]
    return Rows(rid, order, [parents[n] for n in order], [prefix + depth[n] for n in order],
                torch.tensor(tokens(4, rid + 50)))


# Step 1: requests 1 and 2 send their prompts. Step 2: request 0 its whole prompt (chain),
# request 1 a tree layer (mask), request 2 one decode row.
STEPS = [
    lambda: [chain(1, tokens(5, 1), 0, [4]), chain(2, tokens(4, 2), 0, [3])],
    lambda: [chain(0, tokens(7, 0), 0, [6]), tree_layer(1, 5), chain(2, tokens(1, 3), 4)],
]


def run_schedule(model, packed: bool) -> list[list[torch.Tensor]]:
    """Each step's output per part: packed in one forward, or one table and cache per request."""
    tables = {}
    if packed:
        table = SlotTable(16, BLOCK)
        kv = model.make_kv_cache(table.num_slots)
    for rid in (0, 1, 2):
        if not packed:
            table = SlotTable(8, BLOCK)
            kv = model.make_kv_cache(table.num_slots)
        table.admit(rid)
        tables[rid] = (table, kv)
    outs = []
    for make_step in STEPS:
        step = make_step()
        if packed:
            res = run_packed(model, kv, table, step)
            assert not res.failed and all(o is not None for o in res.outputs)
            outs.append(res.outputs)
        else:
            outs.append([])
            for rows in step:
                table, kv = tables[rows.request_id]
                outs[-1] += run_packed(model, kv, table, [rows]).outputs
        # Commit the chains so that the next step extends them; tree nodes stay speculative.
        for rows in step:
            if rows.node_ids[0] < 100:
                tables[rows.request_id][0].commit(rows.request_id, rows.node_ids)
    return outs


@pytest.mark.parametrize("last", [True, False], ids=["logits", "hidden"])
def test_packed_requests_equal_each_alone(tiny_llama_dir, last):
    ckpt = open_checkpoint(tiny_llama_dir)
    # The last stage returns logits of the head rows; a first stage returns every row's hidden state.
    model = build_stage(ckpt, StageSpec(0, 4, True, True) if last else StageSpec(0, 2, True, False))
    packed = run_schedule(model, packed=True)
    alone = run_schedule(model, packed=False)
    for make_step, a, b in zip(STEPS, packed, alone):
        step = make_step()
        for rows, x, y in zip(step, a, b):
            want = len(rows.head_rows) if last and rows.head_rows is not None else len(rows)
            assert x.shape[0] == want and x.shape == y.shape
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-5), (rows.request_id, (x - y).abs().max())
            assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_two_parts_of_one_request_in_one_forward(tiny_llama_dir):
    """A request's second part may hang below its first part's nodes: all K/V are written before
    any attention, so the later segment reads the earlier one's slots."""
    ckpt = open_checkpoint(tiny_llama_dir)
    model = build_stage(ckpt, StageSpec.whole(ckpt.config))
    toks = tokens(9, 7)
    table = SlotTable(8, BLOCK)
    kv = model.make_kv_cache(table.num_slots)
    table.admit(0)
    split = run_packed(model, kv, table, [chain(0, toks[:5], 0, []), chain(0, toks[5:], 5)]).outputs
    ref_table = SlotTable(8, BLOCK)
    ref_kv = model.make_kv_cache(ref_table.num_slots)
    ref_table.admit(0)
    whole = run_packed(model, ref_kv, ref_table, [chain(0, toks, 0, [5, 6, 7, 8])]).outputs[0]
    assert split[0].shape[0] == 0
    assert torch.allclose(split[1], whole, atol=1e-5, rtol=1e-5)


def test_a_request_out_of_blocks_fails_alone(tiny_llama_dir):
    ckpt = open_checkpoint(tiny_llama_dir)
    model = build_stage(ckpt, StageSpec.whole(ckpt.config))
    table = SlotTable(3, BLOCK)
    kv = model.make_kv_cache(table.num_slots)
    for rid in (0, 1, 2):
        table.admit(rid)
    # Request 1 needs 3 blocks when request 0 already took one: it fails; 2 still fits after it.
    parts = [chain(0, tokens(3, 0), 0, [2]), chain(1, tokens(9, 1), 0, [8]), chain(2, tokens(2, 2), 0, [1])]
    res = run_packed(model, kv, table, parts)
    assert res.failed == [1] and res.outputs[1] is None
    assert table.requests[1].failed and len(table.requests[1].blocks) == 0
    alone = SlotTable(1, BLOCK)
    alone_kv = model.make_kv_cache(alone.num_slots)
    alone.admit(2)
    ref = run_packed(model, alone_kv, alone, [parts[2]]).outputs[0]
    assert torch.allclose(res.outputs[2], ref, atol=1e-5, rtol=1e-5)
