"""`--quantization` reaches every stage, in-process and as stage processes: the stages then hold
their weights as Q8_0 / Q4_0 blocks (their reported weight bytes shrink), and the output is a
function of the quantized model alone (in-process and process stages agree)."""

from __future__ import annotations

from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams

PROMPT = [5, 17, 33, 90, 5, 17, 33]


def run(model, **options):
    engine = Engine(EngineConfig(model=str(model), stages=2, kv_memory="1MiB", **options))
    try:
        out = engine.generate(PROMPT, SamplingParams(max_tokens=6))
        return out.token_ids, [st["weight_bytes"] for st in out.stats["stages"]]
    finally:
        engine.close()


def test_quantization_reaches_every_stage(tiny_llama_dir):
    _, float_bytes = run(tiny_llama_dir, transport="inproc")
    tokens = {}
    for q, share in (("int8", 0.5), ("int4", 0.35)):
        tokens[q], held = run(tiny_llama_dir, transport="inproc", quantization=q)
        assert all(h < share * f for h, f in zip(held, float_bytes)), (q, held, float_bytes)
    by_process, held = run(tiny_llama_dir, transport="processes", quantization="int4")
    assert by_process == tokens["int4"]
    assert all(h < 0.35 * f for h, f in zip(held, float_bytes))
