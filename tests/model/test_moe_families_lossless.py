"""The sparse-expert families of 2026 in every mode: the tokens of plain pp. DeepSeek V2 and V3
(latent attention, a latent KV cache, DeepSeek's MoE), GLM-4.5 (`glm4_moe`) and MiniMax-M2
(`minimax_m2`; sigmoid routing with groups and a correction bias).

Each mode, greedy at S = 1 and 3 (the 4-layer tiny models split 2+1+1 at S = 3: the dense layer
and a sparse one, then sparse layers alone) and seeded at S = 2 (to keep the time down), with a
same-family draft (the target's first two layers) merged with n-grams, and prefix caching on at
the stages and in the draft: a first request, then a chat turn that repeats it, served partly from
cached blocks. Tree rows read the (latent) cache under tree masks, pruned nodes free their slots
and committed nodes move theirs; a tree row's experts and weights are those the row computed
alone in pp (the router is batch invariant, model/moe.py): the tokens must not change.

Then, per family, a stage restart and a structured request: the stages die in the middle of the
second request and the engine's RestartingPipeline starts them again (pp and two speculative
modes, seeded), and a JSON-schema request in every mode; both give pp's tokens. Last, DeepSeek's
attn_k_b / attn_v_b as a quantized llama.cpp file stores them, kept packed: the file's bytes, the
float path's tokens on exact weights, and every mode equal to pp.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Callable, Optional

import pytest

from specpipe.config import MODES, SPECULATIVE_MODES, StageSpec
from specpipe.distributed.remote_pipeline import PipelineError
from specpipe.engine import restart
from specpipe.engine.core import EngineCore
from specpipe.engine.restart import RestartingPipeline
from specpipe.grammar.compiler import CompiledGrammar, GrammarCompiler
from specpipe.grammar.matcher import RequestGrammar
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams, StructuredOutput
from specpipe.sched.prefix_cache import PrefixCache
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import MergedSource, NgramSource
from specpipe.tokenizer.tokenizer import Tokenizer
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

BLOCKS, BLOCK_SIZE = 96, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=12)
PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17]  # repeats, so n-grams propose too
# Structured output: a free string, a number and an enum, so the model chooses (json.dumps's layout,
# no free whitespace: grammar/sandbox.py), at most ~45 byte tokens of the tiny tokenizer.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "color"], "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "color": {"enum": ["red", "green", "blue"]}}}
STRUCTURED = SamplingParams(temperature=0.0, max_tokens=64)


class DiesOnce(LocalPipeline):
    """Stages that die at the first collect after `when()` holds: the PipelineError a killed stage
    process gives the driver (distributed/remote_pipeline.py), here on in-process stages."""

    def __init__(self, workers: list[StageWorker], when: Callable[[], bool]) -> None:
        super().__init__(workers)
        self.when: Optional[Callable[[], bool]] = when

    def collect(self):
        if self.when is not None and self.when():
            self.when = None
            raise PipelineError("stage 2 died (killed)")
        return super().collect()


def serve(ckpt, mode: str, num_stages: int, sampling: SamplingParams, cached: bool,
          die_after: Optional[int] = None, grammar: Optional[CompiledGrammar] = None,
          turns: int = 2) -> list[Request]:
    """A first request, then a second turn whose prompt holds the first's prompt and output, on
    fresh stages under one engine core; returns both. `die_after`: the stages die once the second
    request has that many output tokens, and the engine's RestartingPipeline (engine/restart.py)
    starts fresh ones, which recompute it from its prompt and output so far. `grammar`: both
    requests constrained by it (structured output), each with its own matcher. `turns` = 1: the
    first request alone."""
    def stages() -> list[StageWorker]:
        return [StageWorker(build_stage(ckpt, s), BLOCKS, BLOCK_SIZE)
                for s in partition_layers(ckpt.config.num_layers, num_stages)]

    workers = stages()
    if ckpt.config.mla is not None:
        assert all(w.kv.v is None for w in workers)  # every stage keeps the latent only
    dying: list[Request] = []  # the request whose progress kills the stages
    if die_after is None:
        pipe = LocalPipeline(workers)
    else:
        starts = iter([lambda: DiesOnce(workers, lambda: bool(dying) and len(dying[0].output_ids) >= die_after),
                       lambda: LocalPipeline(stages())])
        pipe = RestartingPipeline(lambda: next(starts)(), 1)
    source = None
    if mode in SPECULATIVE_MODES:
        draft = DraftModelSource(build_stage(ckpt, StageSpec(0, 2, first=True, last=True)), BLOCKS, BLOCK_SIZE,
                                 "self:2")
        if cached:
            draft.enable_prefix_cache(PrefixCache(BLOCK_SIZE))
        source = MergedSource([draft, NgramSource()])
    core = EngineCore(pipe, mode, source, width=4, depth=3, kv_blocks=BLOCKS,
                      block_size=BLOCK_SIZE, max_num_seqs=4, step_rows=8,
                      prefix_cache=PrefixCache(BLOCK_SIZE) if cached else None)

    def matcher() -> Optional[RequestGrammar]:
        return None if grammar is None else RequestGrammar(grammar)

    first = Request(0, list(PROMPT), sampling, frozenset(), grammar=matcher())
    core.run([first])
    if turns == 1:
        assert not any(w.slots.requests for w in workers)
        return [first]
    second = Request(1, PROMPT + first.output_ids + [200, 201, 202], sampling, frozenset(), grammar=matcher())
    dying.append(second)
    core.run([second])
    if die_after is not None:  # it died mid-request, once, and the stages were started again
        assert pipe.restarted == 1 and core.stage_restarts == 1, (mode, num_stages)
        assert second.stats.stage_restarts == 1 and first.stats.stage_restarts == 0, (mode, num_stages)
        assert die_after < len(second.output_ids), (mode, num_stages)
        workers = pipe.inner.workers
    for w in workers:  # every request's KV released; only cached blocks may remain
        assert not w.slots.requests
    return [first, second]


def assert_every_mode_equals_pp(ckpt, sampling: SamplingParams, what: str) -> None:
    """Greedy at S = 1 and 3, seeded at S = 2: every mode's two requests (the second reading the
    first's prompt from the prefix cache) give pp's tokens."""
    reference = [r.output_ids for r in serve(ckpt, "pp", 1, sampling, cached=False)]
    assert all(len(out) == sampling.max_tokens and len(set(out)) > 3 for out in reference)
    for num_stages, mode in itertools.product([1, 3] if sampling.temperature == 0 else [2], MODES):
        first, second = serve(ckpt, mode, num_stages, sampling, cached=True)
        assert [first.output_ids, second.output_ids] == reference, f"{what}: {mode} at S={num_stages}"
        assert second.stats.cached_tokens >= len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE, (mode, num_stages)


def assert_restart_equals_pp(ckpt, sampling: SamplingParams, what: str, monkeypatch) -> None:
    """The stages die in the middle of the second request (its prompt partly read from the prefix
    cache, which dies with them) and are started again; seeded sampling, pp at S = 2 and two
    speculative modes at S = 2 and 3: the tokens of an undisturbed pp."""
    monkeypatch.setattr(restart, "backoff_s", lambda in_a_row: 0.0)  # no wait before the restart
    reference = [r.output_ids for r in serve(ckpt, "pp", 1, sampling, cached=False)]
    for mode, num_stages in [("pp", 2), ("specpipe", 3), ("specpipe-db", 2)]:
        got = serve(ckpt, mode, num_stages, sampling, cached=True, die_after=sampling.max_tokens // 2)
        assert [r.output_ids for r in got] == reference, f"{what}: {mode} at S={num_stages} after a restart"


def assert_structured_equal_in_every_mode(ckpt, model_dir, what: str) -> None:
    """A JSON-schema-constrained request: every mode at S = 2 gives plain constrained pp's tokens
    (S = 1), the draft's candidates filtered by the grammar and the target masked on every tree
    row; the output is JSON of the schema, ended by the grammar (the random model alone writes no
    JSON)."""
    import jsonschema

    tokenizer = Tokenizer.from_path(model_dir)
    compiler = GrammarCompiler(tokenizer, ckpt.config.vocab_size)
    try:
        grammar = compiler.compile(StructuredOutput(json_schema=SCHEMA))
        reference = serve(ckpt, "pp", 1, STRUCTURED, cached=False, grammar=grammar, turns=1)
        for r in reference:
            assert r.finish_reason == "stop", (what, r.finish_reason, r.error, tokenizer.decode(r.output_ids))
            jsonschema.validate(json.loads(tokenizer.decode(r.output_ids)), SCHEMA)
        plain = serve(ckpt, "pp", 1, STRUCTURED, cached=False, turns=1)[0]
        assert plain.output_ids[:len(reference[0].output_ids)] != reference[0].output_ids  # the grammar steered
        for mode in MODES:
            got = serve(ckpt, mode, 2, STRUCTURED, cached=True, grammar=grammar, turns=1)
            assert [r.output_ids for r in got] == [r.output_ids for r in reference], f"{what}: {mode}"
            assert all(r.finish_reason == "stop" and r.grammar.closed for r in got), mode
            if mode in SPECULATIVE_MODES:
                assert sum(r.stats.hits for r in got) > 0, mode  # grammar-filtered proposals were accepted
    finally:
        compiler.close()


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2"])
def test_every_mode_equals_pp(tiny_model_dir, family, sampling):
    assert_every_mode_equals_pp(open_checkpoint(tiny_model_dir(family)), sampling, family)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2"])
def test_every_mode_equals_pp_across_a_stage_restart(tiny_model_dir, family, monkeypatch):
    assert_restart_equals_pp(open_checkpoint(tiny_model_dir(family)), SAMPLED, family, monkeypatch)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2"])
def test_structured_request_equal_in_every_mode(tiny_model_dir, family):
    path = tiny_model_dir(family)
    assert_structured_equal_in_every_mode(open_checkpoint(path), path, family)


def with_quantized_halves(path, out):
    """llama.cpp's converted file at `path` rewritten at `out` with each layer's attn_k_b in Q5_0 (as
    llama.cpp's Q4_K_M leaves DeepSeek's: its rows of qk_nope_head_dim are no multiple of 256) and
    attn_v_b in Q8_0 (gguf's quantizer has no Q4_K), the rest as converted (float32)."""
    import gguf
    import numpy as np

    from specpipe.loader.gguf_metadata import read_gguf_metadata

    types = {"attn_k_b.weight": gguf.GGMLQuantizationType.Q5_0, "attn_v_b.weight": gguf.GGMLQuantizationType.Q8_0}
    meta = read_gguf_metadata(path)
    wr = gguf.GGUFWriter(str(out), meta["general.architecture"])
    for key, value in meta.items():
        if key.startswith(("general.", "tokenizer.")) and key != "tokenizer.ggml.eos_token_id":
            continue
        {bool: wr.add_bool, int: wr.add_uint32, float: wr.add_float32, str: wr.add_string}[type(value)](key, value)
    for t in gguf.GGUFReader(path).tensors:
        qtype = types.get(t.name.split(".", 2)[-1])
        data = np.array(t.data)
        if qtype is None:
            wr.add_tensor(t.name, data)
        else:
            wr.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return out


def test_quantized_latent_halves_stay_packed_and_every_mode_equals_pp(tiny_model_dir, tmp_path, monkeypatch):
    """DeepSeek-V2 converted by llama.cpp's converter, its attn_k_b / attn_v_b quantized: a stage
    keeps them in their blocks, one matrix a head (model/mla.py use_packed_halves), holding the
    file's bytes of them instead of a float32 kv_b_proj. On the `dequant` kernel (the exact weights,
    float activations) the tokens are those of the halves joined and dequantized (the path before);
    on the default kernel (8-bit activations, as llama.cpp's dot products) every mode gives pp's."""
    import gguf
    from llama_converter import convert

    from specpipe.kernels.qlinear import QuantLinear
    from specpipe.loader.gguf import GGUFCheckpoint
    from specpipe.model.mla import LatentAttention

    hf_dir = tiny_model_dir("deepseek_v2", qk_nope_head_dim=32)  # rows of 32: one block of Q5_0 / Q8_0
    path = with_quantized_halves(convert(hf_dir, tmp_path / "f32.gguf"), tmp_path / "halves.gguf")
    ckpt = open_checkpoint(path)
    records = {t.name: t for t in gguf.GGUFReader(path).tensors}
    stage = build_stage(ckpt, StageSpec.whole(ckpt.config))
    latent = [m for m in stage.modules() if isinstance(m, LatentAttention)]
    assert len(latent) == ckpt.config.num_layers
    for i, attn in enumerate(latent):
        assert attn.kv_b_proj is None and len(attn.k_b) == len(attn.v_b) == ckpt.config.num_heads
        assert all(isinstance(m, QuantLinear) for m in [*attn.k_b, *attn.v_b])
        assert {m.qtype.name for m in attn.k_b} == {"Q5_0"} and {m.qtype.name for m in attn.v_b} == {"Q8_0"}
        held = sum(m.weight_nbytes for m in [*attn.k_b, *attn.v_b])
        assert held == records[f"blk.{i}.attn_k_b.weight"].n_bytes + records[f"blk.{i}.attn_v_b.weight"].n_bytes
        assert held < math.prod(ckpt.shape(f"layers.{i}.self_attn.kv_b_proj.weight")) * 4 / 3  # float32: 4 B a weight

    monkeypatch.setenv("SPECPIPE_KERNEL", "dequant")
    assert build_stage(ckpt, StageSpec.whole(ckpt.config)).layers["0"].self_attn.k_b[0].kernel == "dequant"
    exact = [r.output_ids for r in serve(ckpt, "pp", 2, GREEDY, cached=False)]
    with monkeypatch.context() as joined:
        joined.setattr(GGUFCheckpoint, "kv_b_halves", lambda self, name: None)
        assert build_stage(ckpt, StageSpec.whole(ckpt.config)).layers["0"].self_attn.k_b is None
        assert [r.output_ids for r in serve(ckpt, "pp", 2, GREEDY, cached=False)] == exact
    monkeypatch.delenv("SPECPIPE_KERNEL")
    assert_every_mode_equals_pp(ckpt, GREEDY, "deepseek_v2, packed attn_k_b / attn_v_b")
