"""The benchmark pictures: the boxes of the pipeline timeline are the simulator's spans split by
the trace's work (checked exactly); the pictures are real PNGs; bad input is refused."""

import pytest
from matplotlib.image import imread

from specpipe.bench.plots import (
    UNKNOWN,
    _boxes,
    tbt_distributions,
    timeline,
    tokens_per_step_vs_stages,
)
from specpipe.costs.profile import CostProfile
from specpipe.engine.core import EngineCore
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sim.events import simulate
from specpipe.sim.oracle_pipeline import OraclePipeline
from specpipe.sim.trace import StepRecord, StepTracer, Trace
from specpipe.spec_decode.sources import NgramSource

PNG = b"\x89PNG\r\n\x1a\n"
PROFILE = CostProfile("test", [1, 2, 64], [[1.0, 1.5, 10.0]], [0.0] * 3, [], [256], model={"num_layers": 4})


def pp_trace() -> Trace:
    """One request in pp at S = 2: a row crosses stage 1, then stage 2, twice."""
    return Trace({"stages": 2, "mode": "pp", "label": "pp"}, {0: {"arrival": 0.0, "prompt_tokens": 3}},
                 [StepRecord(rows=[3, 0], context=10, tokens={0: 0}, work=[[[0, 0, 3, 0]], []]),
                  StepRecord(rows=[0, 3], context=10, tokens={0: 1}, work=[[], [[0, 0, 3, 0]]]),
                  StepRecord(rows=[1, 0], context=10, tokens={0: 1}, work=[[[0, 0, 1, 0]], []]),
                  StepRecord(rows=[0, 1], context=10, tokens={0: 2}, work=[[], [[0, 0, 1, 0]]])])


def tree_trace() -> Trace:
    """Two requests; stage 1 computes a tree of 4 rows of request 0 (2 pruned later) and 2 of
    request 1 while stage 2 finishes their previous rows."""
    return Trace({"stages": 2, "mode": "specpipe", "label": "specpipe"},
                 {0: {"arrival": 0.0, "prompt_tokens": 3}, 1: {"arrival": 0.0, "prompt_tokens": 2}},
                 [StepRecord(rows=[5, 0], context=10, tokens={0: 0, 1: 0}, work=[[[0, 0, 3, 0], [1, 0, 2, 0]], []]),
                  StepRecord(rows=[6, 5], context=10, tokens={0: 1, 1: 1},
                             work=[[[0, 0, 1, 0], [0, 1, 1, 0], [0, 2, 2, 2], [1, 1, 2, 1]],
                                   [[0, 0, 3, 0], [1, 0, 2, 0]]]),
                  StepRecord(rows=[0, 6], context=10, tokens={0: 3, 1: 2},
                             work=[[], [[0, 0, 1, 0], [0, 1, 1, 0], [0, 2, 2, 2], [1, 1, 2, 1]]])])


def oracle_trace(S=3) -> Trace:
    """A trace recorded from the engine (the oracle stands in for the stages)."""
    prompt = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7]
    core = EngineCore(OraclePipeline(S, prompt + [5, 17, 33, 90, 3, 4, 5, 3, 4, 5]), "specpipe", NgramSource(), width=4)
    core.observer = StepTracer(S, {"mode": "specpipe", "label": "specpipe"})
    core.run([Request(0, prompt, SamplingParams(max_tokens=10), frozenset())])
    return core.observer.finish()


def check_boxes(trace: Trace) -> None:
    sim = simulate(trace, PROFILE, keep_spans=True)
    boxes = _boxes(trace, sim)
    computed = [(k, s) for k, step in enumerate(trace.steps) for s, n in enumerate(step.rows) if n > 0]
    assert [(b.step, b.stage) for b in boxes] == computed
    for b in boxes:
        step = trace.steps[b.step]
        assert (b.start, b.end) == sim.spans[b.step][b.stage]
        assert sum(p[2] for p in b.parts) == pytest.approx(1.0)
        pruned = sum(g[3] for g in step.work[b.stage])
        assert sum(p[3] for p in b.parts) == pytest.approx(pruned / step.rows[b.stage])
        assert [(p[0], p[1]) for p in b.parts] == [(g[0], g[1]) for g in step.work[b.stage]]


def test_boxes_by_hand():
    trace = tree_trace()
    boxes = _boxes(trace, simulate(trace, PROFILE, keep_spans=True))
    # Step 1, stage 1: 6 rows -> request 0 at depths 0, 1, 2 (1, 1, 2 rows, the 2 pruned) and
    # request 1 at depth 1 (2 rows, 1 pruned).
    assert boxes[1].parts == [(0, 0, 1 / 6, 0.0), (0, 1, 1 / 6, 0.0), (0, 2, 2 / 6, 2 / 6), (1, 1, 2 / 6, 1 / 6)]
    check_boxes(trace)
    check_boxes(pp_trace())


def test_boxes_of_a_recorded_trace():
    trace = oracle_trace()
    assert any(g[3] for s in trace.steps for stage in s.work for g in stage)  # something was pruned
    check_boxes(trace)


def test_a_trace_without_work_is_one_part_per_box():
    trace = pp_trace()
    for s in trace.steps:
        s.work = []
    boxes = _boxes(trace, simulate(trace, PROFILE, keep_spans=True))
    assert len(boxes) == 4 and all(b.parts == [(UNKNOWN, 0, 1.0, 0.0)] for b in boxes)


def check_png(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    return imread(path).shape[:2]


def test_timeline_grows_with_panels(tmp_path):
    recorded = oracle_trace()
    one = check_png(timeline([("specpipe", recorded)], PROFILE, tmp_path / "one.png"))
    three = check_png(timeline([("pp", pp_trace()), ("tree", tree_trace()), ("specpipe", recorded)], PROFILE,
                               tmp_path / "sub" / "three.png", max_ms=20.0))
    assert three[0] > 2 * one[0]


def test_summary_pictures(tmp_path):
    h, w = check_png(tbt_distributions([{"label": "pp", "tbt_ms": [10.0, 12.5, 11.0]},
                                        {"label": "specpipe", "tbt_ms": [4.0]}], tmp_path / "tbt.png"))
    assert w > h
    check_png(tokens_per_step_vs_stages(
        [{"label": "specpipe d=1", "stages": s, "tokens_per_step": 0.9} for s in (2, 4, 8)]
        + [{"label": "pp", "stages": s, "tokens_per_step": 1 / s} for s in (2, 4, 8)], tmp_path / "tps.png"))
    check_png(tokens_per_step_vs_stages([{"label": "x", "stages": 4, "tokens_per_step": 0.5}], tmp_path / "one.png"))


def test_bad_input_is_refused(tmp_path):
    out = tmp_path / "x.png"
    empty = Trace({"stages": 2, "label": "e"})
    idle = Trace({"stages": 2}, {}, [StepRecord(rows=[0, 0], context=1)])
    for panels, match in [([], "at least one"), ([("e", empty)], "no steps"), ([("idle", idle)], "no stage computed")]:
        with pytest.raises(ValueError, match=match):
            timeline(panels, PROFILE, out)
    with pytest.raises(ValueError, match="nothing to draw"):
        timeline([("pp", pp_trace())], PROFILE, out, max_ms=0.0)
    with pytest.raises(ValueError, match="keep_spans"):
        _boxes(pp_trace(), simulate(pp_trace(), PROFILE))
    with pytest.raises(ValueError, match="at least one run"):
        tbt_distributions([], out)
    with pytest.raises(ValueError, match="no TBT values"):
        tbt_distributions([{"label": "a", "tbt_ms": []}], out)
    with pytest.raises(ValueError, match="at least one run"):
        tokens_per_step_vs_stages([], out)
    with pytest.raises(ValueError, match="lacks"):
        tokens_per_step_vs_stages([{"label": "a", "stages": 2}], out)
    assert not out.exists()
