"""A draft model decoding the tree with its own tree-masked, pruned KV cache proposes exactly
what it would propose for each node's path run as a plain sequence."""

import numpy as np
import pytest
import torch

from specpipe.config import StageSpec
from engine_helpers import decode
from specpipe.loader import open_checkpoint
from specpipe.messages import NO_PARENT
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sim.oracle_pipeline import OraclePipeline
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import ProposeCall, SourceRows

PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7]


class CheckedDraft(DraftModelSource):
    """Recomputes every proposal from scratch on the node's plain path and compares."""

    checked = 0

    def propose_many(self, calls):
        outs = super().propose_many(calls)  # one packed forward, as the engine calls it
        for c, out in zip(calls, outs):
            tree, k = c.tree, c.k
            for n in c.want:
                path = tree.committed_since(0) + (tree.path_tokens(n) if n != tree.root_id else [])
                m = len(path)
                kv = self.model.make_kv_cache(m)
                logits = run_rows(self.model, kv, torch.tensor(path), list(range(m)), list(range(m)),
                                  list(range(m)), np.tri(m, dtype=bool), [m - 1])
                expected = logits.log_softmax(-1).topk(k, -1)
                assert [t for t, _ in out[n]] == expected.indices[0].tolist(), f"node {n} at {tree.node(n).position}"
                assert np.allclose([lp for _, lp in out[n]], expected.values[0].tolist(), atol=1e-4)
                self.checked += 1
        return outs


@pytest.mark.parametrize("mode", ["specpipe", "tree"])
def test_tree_drafting_equals_plain_path_drafting(tiny_model_dir, mode):
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    target = build_stage(ckpt, StageSpec.whole(ckpt.config))
    draft = CheckedDraft(build_stage(ckpt, StageSpec(0, 3, True, True)), 32, 16, "self:3")
    # the reference output, then decode against an oracle pipeline (fast; the draft is real)
    kv = target.make_kv_cache(64)
    seq = list(PROMPT)
    for _ in range(16):
        m = len(seq)
        logits = run_rows(target, kv, torch.tensor(seq), list(range(m)), list(range(m)), list(range(m)),
                          np.tri(m, dtype=bool), [m - 1])
        seq.append(int(logits.argmax()))
    req = Request(0, PROMPT, SamplingParams(max_tokens=16), frozenset())
    if mode == "specpipe":
        decode(OraclePipeline(4, seq), req, "specpipe", draft, 4)
    else:
        decode(OraclePipeline(4, seq), req, "tree", draft, 4, 3)
    assert req.output_ids == seq[len(PROMPT):]
    assert draft.checked > 12 and req.stats.hits > 0


def test_propose_many_equals_propose_per_request(tiny_model_dir):
    """One packed forward for three requests (a prompt, a tree layer under a prompt, one decode
    row) proposes what each request's own draft proposes."""
    ckpt = open_checkpoint(tiny_model_dir("llama"))

    def draft():
        return DraftModelSource(build_stage(ckpt, StageSpec(0, 3, True, True)), 8, 4, "self:3")

    def prompt(n, seed):
        toks = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        return SourceRows(list(range(n)), [NO_PARENT] + list(range(n - 1)), list(range(n)), toks)

    # The tree argument is not read by a model source.
    first = [ProposeCall(1, None, prompt(5, 1), [4], 3), ProposeCall(2, None, prompt(4, 2), [3], 3)]
    second = [
        ProposeCall(0, None, prompt(7, 0), [6], 4),
        ProposeCall(1, None, SourceRows([10, 11, 12], [4, 10, 10], [5, 6, 6], [7, 8, 9]), [11, 12], 3),
        ProposeCall(2, None, SourceRows([4], [3], [4], [21]), [4], 2),
    ]
    packed, alone = draft(), {rid: draft() for rid in (0, 1, 2)}
    for rid in (0, 1, 2):
        packed.start(rid)
        alone[rid].start(rid)
    for calls in (first, second):
        got = packed.propose_many(calls)
        want = [alone[c.request_id].propose(c.request_id, c.tree, c.rows, c.want, c.k) for c in calls]
        for g, w, c in zip(got, want, calls):
            assert list(g) == list(c.want) == list(w)
            for n in c.want:
                assert len(g[n]) == c.k and [t for t, _ in g[n]] == [t for t, _ in w[n]]
                assert np.allclose([lp for _, lp in g[n]], [lp for _, lp in w[n]], atol=1e-5)
        for c in calls:  # the prompts join the committed prefix, the tree stays speculative
            if c.request_id != 1 or calls is first:
                packed.observe(c.request_id, c.rows.node_ids, [])
                alone[c.request_id].observe(c.request_id, c.rows.node_ids, [])
    for rid in (0, 1, 2):
        packed.finish(rid)
    assert packed.slots.total_in_use() == 0 and packed.slots.blocks_in_use() == 0


def test_draft_out_of_blocks_drops_only_that_request(tiny_model_dir):
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    source = DraftModelSource(build_stage(ckpt, StageSpec(0, 3, True, True)), 2, 4, "self:3")
    rows = [SourceRows(list(range(n)), [NO_PARENT] + list(range(n - 1)), list(range(n)), [5] * n) for n in (3, 6)]
    source.start(0)
    source.start(1)
    got = source.propose_many([ProposeCall(0, None, rows[0], [2], 2), ProposeCall(1, None, rows[1], [5], 2)])
    assert len(got[0][2]) == 2 and got[1] == {}
    assert source.slots.requests[1].failed and source.slots.blocks_in_use() == 1
    assert source.propose(1, None, SourceRows([6], [5], [6], [5]), [6], 2) == {}  # until it finishes
    source.finish(1)


def test_a_draft_vocabulary_proposes_the_best_of_its_tokens(tiny_model_dir):
    """With vocab_ids the draft's head computes those rows only, and it proposes the top-k of the
    whole head's distribution restricted to them, as token ids of the whole vocabulary."""
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    ids = torch.tensor([0, 3, 7, 50, 51, 120, 200, 299])
    full = DraftModelSource(build_stage(ckpt, StageSpec(0, 3, True, True)), 8, 4, "self:3")
    part = DraftModelSource(build_stage(ckpt, StageSpec(0, 3, True, True)), 8, 4, "self:3", vocab_ids=ids)
    assert part.model.lm_head.weight.shape[0] == len(ids)
    rows = SourceRows(list(range(6)), [NO_PARENT] + list(range(5)), list(range(6)), [5, 17, 33, 90, 5, 17])
    for src in (full, part):
        src.start(0)
    m = len(rows.node_ids)
    kv = full.model.make_kv_cache(m)
    logits = run_rows(full.model, kv, rows.tokens, list(range(m)), list(range(m)), list(range(m)),
                      np.tri(m, dtype=bool), [m - 1])[0]
    want = logits[ids].log_softmax(-1).topk(5)
    got = part.propose(0, None, rows, [5], 5)[5]
    assert [t for t, _ in got] == ids[want.indices].tolist()
    assert np.allclose([lp for _, lp in got], want.values.tolist(), atol=1e-4)
    assert len(part.propose(0, None, SourceRows([6], [5], [6], [9]), [6], 20)[6]) == len(ids)  # k > |vocab|


def test_frequent_ids_keep_the_special_tokens(tiny_model_dir):
    from specpipe.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_path(tiny_model_dir("llama"))
    ids = tok.frequent_ids(100)
    assert ids[:100] == list(range(100)) and ids == sorted(set(ids))
    assert set(tok.eos_token_ids) <= set(ids) and set(tok.added_token_ids()) <= set(ids)
    assert tok.frequent_ids(10 ** 9) == list(range(tok.vocab_size))
    with pytest.raises(ValueError):
        tok.frequent_ids(0)


def test_draft_vocab_needs_a_draft_model(tiny_model_dir):
    from specpipe.config import ConfigError
    from specpipe.spec_decode.build import build_source
    from specpipe.tokenizer.tokenizer import Tokenizer

    path = tiny_model_dir("llama")
    ckpt, tok = open_checkpoint(path), Tokenizer.from_path(path)
    with pytest.raises(ConfigError, match="draft model"):
        build_source("ngram", ckpt, tok, 8, 4, draft_vocab=100)
    merged = build_source("self:2+ngram", ckpt, tok, 8, 4, draft_vocab=100)
    assert merged.sources[0].model.lm_head.weight.shape[0] == len(merged.sources[0].vocab_ids) >= 100


def test_draft_quantization_requantizes_only_wider_blocks(tiny_model_dir, tmp_path):
    """--draft-quantization int4 turns a draft's Q8_0 weights into Q4_0 blocks of their
    dequantized values (fewer bytes per forward); int8 keeps Q4_0 weights as they are (never
    widened); a float checkpoint is quantized as --quantization would."""
    import gguf
    from checkpoint_helpers import gguf_twin

    from specpipe.kernels.qlinear import QuantEmbedding, QuantLinear
    from specpipe.model.stage import weight_nbytes

    Q = gguf.GGMLQuantizationType
    q8 = open_checkpoint(gguf_twin(tiny_model_dir("llama"), tmp_path / "q8.gguf", Q.Q8_0))
    spec = StageSpec.whole(q8.config)
    as_stored = build_stage(q8, spec)
    int4 = build_stage(q8, spec, quantization="int4", requantize=True)
    packed = [m for m in int4.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert packed and {m.qtype for m in packed} == {Q.Q4_0}
    assert weight_nbytes(int4) < weight_nbytes(as_stored)
    src = "layers.0.mlp.down_proj.weight"
    want = gguf.quants.quantize(q8.load(src).numpy(), Q.Q4_0)
    assert np.array_equal(int4.get_submodule("layers.0.mlp.down_proj").packed.numpy(), want)

    q4 = open_checkpoint(gguf_twin(tiny_model_dir("llama"), tmp_path / "q4.gguf", Q.Q4_0))
    kept = build_stage(q4, spec, quantization="int8", requantize=True)
    assert {m.qtype for m in kept.modules() if isinstance(m, QuantLinear)} == {Q.Q4_0}
    assert weight_nbytes(kept) == weight_nbytes(build_stage(q4, spec))
    with pytest.raises(ValueError, match="requantize needs"):
        build_stage(q4, spec, requantize=True)


def test_draft_quantization_reaches_every_draft_model_and_needs_one(tiny_model_dir):
    from specpipe.config import ConfigError, EngineConfig
    from specpipe.kernels.qlinear import QuantLinear
    from specpipe.spec_decode.build import build_source
    from specpipe.tokenizer.tokenizer import Tokenizer

    path = tiny_model_dir("llama")
    ckpt, tok = open_checkpoint(path), Tokenizer.from_path(path)
    merged = build_source("self:2+ngram", ckpt, tok, 8, 4, draft_quantization="int4")
    assert {m.qtype.name for m in merged.sources[0].model.modules() if isinstance(m, QuantLinear)} == {"Q4_0"}
    with pytest.raises(ConfigError, match="--draft-quantization applies to a draft model"):
        build_source("ngram", ckpt, tok, 8, 4, draft_quantization="int4")
    with pytest.raises(ConfigError, match="no effect in mode pp"):
        EngineConfig(mode="pp", draft_quantization="int4").validate()
    with pytest.raises(ConfigError, match="int8 or int4"):
        EngineConfig(mode="specpipe", draft_quantization="int2").validate()
