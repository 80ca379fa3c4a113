"""Stage workers in a LocalPipeline serving several requests in the same steps: a request whose
KV pool runs out at one stage fails alone (one failed result, its KV freed everywhere once
released) while the others go on with exactly the tokens they get alone; reports ride on steps."""

from __future__ import annotations

import pytest
import torch

from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.messages import NO_PARENT, Admit, Control, Prune, Rows
from specpipe.model.stage import build_stage
from specpipe.sampling import SamplingParams
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=6)


def pipeline(ckpt, pools: list[int]) -> LocalPipeline:
    """One stage per entry of `pools` (its number of blocks), layers split evenly."""
    n, S = ckpt.config.num_layers, len(pools)
    specs = [StageSpec(i * n // S, (i + 1) * n // S, i == 0, i == S - 1) for i in range(S)]
    return LocalPipeline([StageWorker(build_stage(ckpt, s), b, BLOCK) for s, b in zip(specs, pools)])


def decode_pp(pipe: LocalPipeline, prompts: dict[int, list[int]], sampling: dict[int, SamplingParams]):
    """Plain pipelined decoding of every request at once (node id = position). Returns
    ({request: tokens}, {request: step at which it failed})."""
    out = {rid: [] for rid in prompts}
    failed: dict[int, int] = {}
    control = Control(admit=[Admit(rid, sampling[rid]) for rid in prompts],
                      prune=[Prune(rid, commit=list(range(len(p)))) for rid, p in prompts.items()])
    rows = [Rows(rid, list(range(len(p))), [NO_PARENT] + list(range(len(p) - 1)), list(range(len(p))),
                 torch.tensor(p), head_rows=[len(p) - 1]) for rid, p in prompts.items()]
    live = set(prompts)
    step = 0
    while live:
        results = pipe.step(control, rows)
        step += 1
        control, rows = Control(), []
        for res in results:
            if res.failed:
                assert res.request_id not in failed, "one failed result per request"
                failed[res.request_id] = step
                live.discard(res.request_id)
                control.release.append(res.request_id)
                continue
            tok = res.tokens[-1]
            out[res.request_id].append(tok)
            if len(out[res.request_id]) == sampling[res.request_id].max_tokens:
                live.discard(res.request_id)
                control.release.append(res.request_id)
                continue
            pos = len(prompts[res.request_id]) + len(out[res.request_id]) - 1
            rows.append(Rows(res.request_id, [pos], [pos - 1], [pos], torch.tensor([tok])))
            control.prune.append(Prune(res.request_id, commit=[pos]))
    pipe.step(control, [])  # the last releases
    return out, failed


PROMPTS = {0: [5, 17, 33, 90, 5, 17, 33, 90], 1: [7, 8, 9, 10, 11, 12, 13]}


@pytest.mark.parametrize("pools", [[5, 5], [64, 5], [5, 64]], ids=["both", "last-stage", "first-stage"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_out_of_blocks_fails_one_request_only(tiny_llama_dir, pools, sampling):
    ckpt = open_checkpoint(tiny_llama_dir)
    params = {0: sampling, 1: sampling}
    alone = {rid: decode_pp(pipeline(ckpt, [64, 64]), {rid: p}, params)[0][rid] for rid, p in PROMPTS.items()}
    assert all(len(t) == sampling.max_tokens for t in alone.values())

    # Five blocks of 4 slots: request 0 (8 + 6 slots) needs 4 blocks, request 1 (7 + 6) 4 as well;
    # both start with 2, request 0 takes the fifth at its ninth slot, request 1 then finds none.
    pipe = pipeline(ckpt, pools)
    out, failed = decode_pp(pipe, PROMPTS, params)
    assert list(failed) == [1]
    assert out[0] == alone[0]  # the survivor is unaffected, token for token
    assert out[1] == alone[1][:len(out[1])]  # what request 1 got before failing was right
    small = [i for i, b in enumerate(pools) if b == 5]
    for i, w in enumerate(pipe.workers):
        assert not w.slots.requests and w.slots.blocks_in_use() == 0  # all released
        assert w.stats.requests_failed == (i == small[0])  # counted where the pool ran out


def test_reports_ride_on_steps(tiny_llama_dir):
    ckpt = open_checkpoint(tiny_llama_dir)
    pipe = pipeline(ckpt, [8, 6])
    pipe.step(Control(admit=[Admit(0, GREEDY)]), [Rows(0, [0, 1], [NO_PARENT, 0], [0, 1], torch.tensor([3, 4]))])
    assert pipe.reported is None
    pipe.step(Control(report=True), [])
    first, last = pipe.reported
    assert (first["num_blocks"], last["num_blocks"]) == (8, 6)
    assert first["blocks_in_use"] == last["blocks_in_use"] == 1
    assert first["steps"] == 2 and first["rows_computed"] == last["rows_computed"] == 2
    pipe.step(Control(release=[0]), [])
    assert pipe.reported is None
    pipe.step(Control(report=True), [])
    assert [r["blocks_in_use"] for r in pipe.reported] == [0, 0]


def test_reports_say_what_each_stage_holds(tiny_llama_dir):
    """Weights as held (a tied LM head counted once), the KV cache, and the resident memory of the
    process the stages run in, in-process stages included."""
    ckpt = open_checkpoint(tiny_llama_dir)
    pipe = pipeline(ckpt, [8, 8])
    pipe.step(Control(report=True), [])
    for worker, rep in zip(pipe.workers, pipe.reported):
        model = worker.model
        params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # float weights
        assert rep["weight_bytes"] == sum(params.values()) > 0
        assert rep["kv_bytes"] == worker.kv.nbytes() > 0
        assert rep["peak_rss_bytes"] >= rep["rss_bytes"] > rep["weight_bytes"]
