"""The step tracer records what the stages computed, and the event simulator times it by the
runtime's rules (checked against hand-computed schedules)."""

import pytest

from specpipe.costs.profile import CostProfile, Link
from specpipe.engine.core import EngineCore
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sim.events import has_stage_spans, measured, simulate
from specpipe.sim.oracle_pipeline import OraclePipeline
from specpipe.sim.trace import StepRecord, StepTracer, Trace
from specpipe.spec_decode.sources import NgramSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

PROMPTS = [[5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7], [9, 8, 7, 9, 8, 7, 9, 8, 3]]


def flat_profile(layer_ms=1.0, head_ms=0.0, draft_ms=0.0, per_row=0.0, row_bytes=0) -> CostProfile:
    """Costs that are easy to add up by hand: layer_ms + per_row x (n - 1) per layer."""
    rows = [1, 2, 64]
    layer = [layer_ms + per_row * (n - 1) for n in rows]
    return CostProfile("test", rows, [layer], [head_ms] * 3, [[draft_ms] * 3], [256],
                       model={"num_layers": 2}, row_bytes=row_bytes)


def trace_of(S, steps) -> Trace:
    return Trace({"stages": S}, {0: {"arrival": 0.0, "prompt_tokens": 1}},
                 [StepRecord(**{"context": 10, **s}) for s in steps])


def pp_two_tokens() -> Trace:
    """One request in pp at S = 2, two tokens: a row crosses stage 1 at steps 0 and 2, stage 2 at
    steps 1 and 3."""
    return trace_of(2, [{"rows": [1, 0], "sent": {0: 1}, "tokens": {0: 0}},
                        {"rows": [0, 1], "tokens": {0: 1}},
                        {"rows": [1, 0], "sent": {0: 1}, "tokens": {0: 1}},
                        {"rows": [0, 1], "tokens": {0: 2}}])


def test_pp_round_trip_by_hand():
    # One request in pp at S = 2: a row crosses stage 1 at step 0 and stage 2 at step 1; 1 ms
    # each, 0.5 ms per message hop, 0.25 ms driver per step.
    t = pp_two_tokens()
    r = simulate(t, flat_profile(), [1, 1], Link("l", 0.5, 0), driver_ms=0.25)
    # step 0: submit .25, stage 1 .75-1.75, results of the empty last stage at 1.25 -> collect 1.25
    # step 1: submit 1.5, stage 2's input left stage 1 at 1.75 -> arrives 2.25, runs to 3.25,
    #         collect 3.75 (first token)
    # step 2: submit 4.0, stage 1 4.5-5.5, collect 5.0; step 3: submit 5.25, input at 6.0,
    #         stage 2 6.0-7.0, collect 7.5 (second token)
    assert r.token_times[0] == [3.75, 7.5]
    assert r.tbt_ms() == [3.75]
    assert r.busy_ms["stage 1"] == r.busy_ms["stage 2"] == 2.0
    assert r.busy_ms["driver"] == 1.0


def test_a_stage_that_idled_pays_what_the_profile_says_it_lost():
    # The pp round trip above, with a profile whose layer costs 0.1 ms more after idling 2 ms and
    # 0.3 ms more after 6 ms or longer: each stage waits for the other, so its second step (after
    # an idle gap) costs more; its first step (nothing to fade) and an empty step do not.
    t = pp_two_tokens()
    busy = simulate(t, flat_profile(), [1, 1], Link("l", 0.5, 0), driver_ms=0.25)
    p = flat_profile()
    p.idle_gaps_ms, p.idle_layer_ms, p.idle_head_ms = [0, 2, 6], {"1": [0.0, 0.1, 0.3]}, []
    idle = simulate(t, p, [1, 1], Link("l", 0.5, 0), driver_ms=0.25)
    # stage 1 ran 0.75-1.75 and again from 4.5: 2.75 ms idle -> 0.1 + 0.75 / 4 x 0.2 = 0.1375 ms
    # more, so it ends at 5.6375; stage 2 ran 2.25-3.25, its input arrives at 6.1375: 2.8875 ms
    # idle -> 0.144375 ms more, ends at 7.281875, and the token reaches the driver 0.5 ms later.
    assert idle.token_times[0][0] == busy.token_times[0][0] == 3.75
    assert idle.token_times[0][1] == pytest.approx(7.781875)
    assert busy.token_times[0][1] == 7.5


def test_the_head_costs_only_the_rows_whose_token_is_wanted():
    # A 64-row prompt chunk wanting its last row's token pays the head for one row, not 64.
    profile = CostProfile("test", [1, 64], [[1.0, 1.0]], [1.0, 64.0], contexts=[256], model={"num_layers": 1})
    every = simulate(trace_of(1, [{"rows": [64], "sent": {0: 64}, "tokens": {0: 1}}]), profile)
    one = simulate(trace_of(1, [{"rows": [64], "sent": {0: 64}, "tokens": {0: 1}, "head_rows": 1}]), profile)
    assert (every.total_ms, one.total_ms) == (65.0, 2.0)


def test_a_batch_is_costed_at_its_rows_mean_context():
    # A layer costs 1 ms at context 0 and 9 ms at context 800 (attention linear in context).
    # One row each of requests at contexts 0, 0, 0 and 800 costs the mean, 200: 3 ms — not the
    # longest one's 9 ms for every row.
    profile = CostProfile("test", [1, 64], [[1.0, 1.0], [9.0, 9.0]], [0.0, 0.0], contexts=[0, 800],
                          model={"num_layers": 1})
    step = {"rows": [4], "sent": {r: 1 for r in range(4)}, "tokens": {r: 1 for r in range(4)},
            "context": 800, "contexts": {0: 0, 1: 0, 2: 0, 3: 800},
            "work": [[[r, 0, 1, 0] for r in range(4)]]}
    t = Trace({"stages": 1}, {r: {"arrival": 0.0, "prompt_tokens": 1} for r in range(4)}, [StepRecord(**step)])
    assert simulate(t, profile).total_ms == pytest.approx(3.0)


def test_a_prompt_chunk_is_costed_at_its_rows_mean_context_on_every_stage():
    # A layer: 1 ms at context 0, 9 ms at 800. A 65-row prompt chunk after no tokens attends on
    # average to 32 tokens besides itself (context 32: 1.32 ms), on stage 1 at step 0 and on
    # stage 2 at step 1, although by then the request's context is 65.
    profile = CostProfile("test", [1, 65], [[1.0, 1.0], [9.0, 9.0]], [0.0, 0.0], contexts=[0, 800],
                          model={"num_layers": 2})
    chunk = [[0, 0, 65, 0]]
    t = trace_of(2, [{"rows": [65, 0], "sent": {0: 65}, "contexts": {0: 0}, "context": 0, "work": [chunk, []]},
                     {"rows": [0, 65], "contexts": {0: 65}, "context": 65, "work": [[], chunk], "head_rows": 1}])
    r = simulate(t, profile, [1, 1], keep_spans=True)
    assert [round(b - a, 6) for a, b in (r.spans[0][0], r.spans[1][1])] == [1.32, 1.32]


def test_a_stage_waits_for_its_input_not_for_the_slowest_stage():
    # Stage 1 computes 64 rows at step 0 (64 ms); stage 2 computes 1 row at steps 0 and 1.
    # Lock-step would start step 1 everywhere after 64 ms; here step 1 starts when the driver has
    # the last stage's results (1 ms), and only stage 2's step 1 waits for stage 1's output.
    t = trace_of(2, [{"rows": [64, 1], "tokens": {0: 1}}, {"rows": [0, 64], "tokens": {0: 2}},
                     {"rows": [1, 0], "tokens": {0: 2}}])
    r = simulate(t, flat_profile(per_row=1.0), [1, 1], keep_spans=True)
    assert r.spans[0] == [(0.0, 64.0), (0.0, 1.0)]
    assert r.collect_ms[0] == 1.0
    assert r.spans[1][1] == (64.0, 128.0)  # waited for stage 1's 64 rows
    assert r.spans[2][0] == (128.0, 129.0)  # the next control came only after step 1's results


def test_draft_overlaps_the_stages_and_serial_draft_does_not():
    t = trace_of(1, [{"rows": [1], "overlapped": [1, 1, 1], "tokens": {0: 1}},
                     {"rows": [1], "serial": [1], "tokens": {0: 2}}])
    r = simulate(t, flat_profile(layer_ms=2.0, draft_ms=1.5), [1])
    assert r.collect_ms == [4.5, 4.5 + 1.5 + 2.0]  # 3 x 1.5 > 2 ms of stage; then 1.5 serial + 2
    assert r.bottleneck() == "draft"
    assert simulate(t, flat_profile(layer_ms=2.0, draft_ms=1.5), [1], draft_cost=False).collect_ms == [2.0, 4.0]


def test_link_bandwidth_counts_the_rows_bytes():
    t = trace_of(2, [{"rows": [8, 0], "tokens": {0: 0}}, {"rows": [0, 8], "tokens": {0: 1}}])
    # At 1 GB/s: 8 token ids (+ 64 control bytes) reach stage 1 after 0.128 microseconds, its 8
    # hidden rows of 1000 bytes (+ 64) reach stage 2 8.064 microseconds after it finished.
    r = simulate(t, flat_profile(row_bytes=1000), [1, 1], Link("l", 0.0, 1.0), keep_spans=True)
    assert r.spans[0][0][0] == pytest.approx(128 / 1e6)
    assert r.spans[1][1][0] == pytest.approx(128 / 1e6 + 1.0 + 8064 / 1e6)


def test_requests_do_not_start_before_they_arrive():
    t = Trace({"stages": 1, "arrivals": "timed"},
              {0: {"arrival": 0.0, "prompt_tokens": 1}, 1: {"arrival": 0.010, "prompt_tokens": 1}},
              [StepRecord([1], 5, sent={0: 1}, tokens={0: 1}), StepRecord([2], 5, sent={0: 1, 1: 1}, tokens={0: 2, 1: 1})])
    r = simulate(t, flat_profile(), [1])
    assert r.token_times == {0: [1.0, 11.0], 1: [11.0]}
    assert r.ttft_ms() == [1.0, 1.0]
    # Closed loop (the default): a request arrives when the engine added it, here after step 0,
    # whatever the wall clock of the recorded run said.
    t.meta.pop("arrivals")
    t.requests[1]["step"] = 1
    r = simulate(t, flat_profile(), [1])
    assert r.token_times == {0: [1.0, 2.0], 1: [2.0]}
    assert r.ttft_ms() == [1.0, 1.0]


def _core(pipe, mode, **kw):
    return EngineCore(pipe, mode, NgramSource() if mode != "pp-cb" else None, width=4, depth=3,
                      max_num_seqs=4, step_rows=64, **kw)


@pytest.mark.parametrize("mode", ["pp-cb", "specpipe-db"])
def test_tracer_follows_the_real_stages(tiny_model_dir, mode, tmp_path):
    """Rows per stage recorded from the driver's messages equal what the stages computed; the
    trace's tokens are the outputs; a saved trace loads back equal."""
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    workers = [StageWorker(build_stage(ckpt, s), 64, 16) for s in partition_layers(4, 2)]
    core = _core(LocalPipeline(workers), mode)
    core.observer = StepTracer(2, {"mode": mode})
    reqs = [Request(i, p, SamplingParams(max_tokens=12), frozenset()) for i, p in enumerate(PROMPTS)]
    core.run(reqs)
    trace = core.observer.finish()
    assert len(trace.steps) == core.steps
    assert [sum(s.rows[k] for s in trace.steps) for k in range(2)] == [w.stats.rows_computed for w in workers]
    final = {}
    for s in trace.steps:
        final.update(s.tokens)
    assert final == {r.request_id: len(r.output_ids) for r in reqs}
    assert sum(s.hits + s.misses for s in trace.steps) == sum(r.stats.verifications for r in reqs)
    for s in trace.steps:  # every row is accounted for by request and depth; pp prunes nothing
        assert [sum(g[2] for g in stage) for stage in s.work] == s.rows
        assert all(0 <= g[3] <= g[2] and g[0] in final for stage in s.work for g in stage)
    # The LM head runs only for rows whose token is wanted: a prompt chunk wants its last row.
    assert all(0 <= s.head_rows <= s.rows[-1] for s in trace.steps)
    assert any(s.head_rows < s.rows[-1] for s in trace.steps)
    wasted = sum(g[3] for s in trace.steps for stage in s.work for g in stage)
    assert (wasted == 0) == (mode == "pp-cb")
    trace.save(tmp_path / "t.json")
    again = Trace.load(tmp_path / "t.json")
    assert again.steps == trace.steps and again.requests == trace.requests
    real = measured(again)
    assert real.tokens == sum(len(r.output_ids) for r in reqs)
    assert all(a <= b for a, b in zip(real.collect_ms, real.collect_ms[1:]))


def test_stage_spans_reach_the_trace(tiny_model_dir):
    """The stages time their own compute; reports carry the spans to the tracer, which files them
    under the step they belong to: one span per stage that computed, inside its step."""
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    workers = [StageWorker(build_stage(ckpt, s), 64, 16) for s in partition_layers(4, 2)]
    core = _core(LocalPipeline(workers), "specpipe-db")
    core.observer = StepTracer(2, {"mode": "specpipe-db"})
    reqs = [Request(i, p, SamplingParams(max_tokens=12), frozenset()) for i, p in enumerate(PROMPTS)]
    core.run(reqs, on_finish=lambda _r: core.request_stage_stats())
    trace = core.observer.finish()
    assert has_stage_spans(trace) and "spans" not in core.stage_stats[0]  # the stats stay counters only
    for s in trace.steps:
        for k, rows in enumerate(s.rows):
            assert bool(s.stage_spans and s.stage_spans[k]) == (rows > 0)
            if rows:  # in-process, the stages compute inside collect()
                start, end = s.stage_spans[k]
                assert s.t_submit <= start <= end <= s.t_collect
    real = measured(trace)
    assert len(real.spans) == len(trace.steps)
    trace.steps[1].stage_spans = []
    assert not has_stage_spans(trace)


def test_oracle_trace_equals_the_oracles_own_row_counts():
    seqs = {i: p + [3, 4, 5, 3, 4, 5, 3, 4] for i, p in enumerate(PROMPTS)}
    pipe = OraclePipeline(4, lambda pid: seqs[pid])
    core = _core(pipe, "specpipe-db")
    core.observer = StepTracer(4)
    core.run([Request(i, p, SamplingParams(max_tokens=8), frozenset()) for i, p in enumerate(PROMPTS)])
    assert [s.rows for s in core.observer.finish().steps] == pipe.rows_per_step


def test_bad_files_are_refused(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a SpecPipe trace"):
        Trace.load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="not a SpecPipe cost profile"):
        CostProfile.load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="cannot read"):
        Trace.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="3 stage layer counts"):
        simulate(trace_of(2, []), flat_profile(), [1, 1, 1])


def test_an_async_draft_is_off_the_critical_path_until_a_step_uses_it():
    # S = 1, a 1 ms stage step, a 5 ms draft forward started before step 0 (--draft-async).
    # Steps 0-2 do not wait for it; step 3 uses its proposals, so it is sent at its end (5 ms);
    # a synchronous draft (serial) would have cost every step its 5 ms instead.
    steps = [{"rows": [1], "sent": {0: 1}, "tokens": {0: k + 1}} for k in range(4)]
    steps[0]["async_started"] = [1]
    steps[3]["async_used"] = 1
    r = simulate(trace_of(1, steps), flat_profile(draft_ms=5.0), [2])
    assert r.collect_ms == [2.0, 4.0, 6.0, 8.0]  # step 3: submit max(6, 5) = 6
    late = [dict(s) for s in steps]
    late[1] = {**late[1], "async_used": 1}  # used at step 1: sent at 5 instead of 2
    late[3] = {k: v for k, v in late[3].items() if k != "async_used"}
    r = simulate(trace_of(1, late), flat_profile(draft_ms=5.0), [2])
    assert r.collect_ms == [2.0, 7.0, 9.0, 11.0]
    assert r.busy_ms["draft"] == 5.0
