"""The driver's record of sends in flight stays bounded over a long run (gloo's is_completed()
never turns true without wait(), so sends used to pile up for the life of the pipeline)."""

from __future__ import annotations

from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams


def test_sends_in_flight_stay_bounded(tiny_model_dir):
    model = tiny_model_dir("llama", num_hidden_layers=2, max_position_embeddings=1024)
    engine = Engine(EngineConfig(model=str(model), stages=2, transport="processes", kv_memory="4MiB",
                                 max_context=1024, restart_stages=0))  # the transport itself, unwrapped
    try:
        t = engine.pipeline.t
        req = engine.prompts.make_request("hello", SamplingParams(max_tokens=300), chat=False, ignore_eos=True)
        engine.run([req])
        assert req.stats.pipeline_steps >= 600  # S = 2 steps per token in pp
        held = sum(len(step) for step in t._inflight)
        # S + 2 steps of sends at most (a control per stage, a rows header and tensor each step).
        assert len(t._inflight) <= t.num_stages + 2 and held <= (t.num_stages + 2) * 8, held
    finally:
        engine.close()
