"""A draft model decoding the tree with its own tree-masked, pruned KV cache proposes exactly
what it would propose for each node's path run as a plain sequence."""

import numpy as np
import pytest
import torch

from specpipe.config import StageSpec
from specpipe.engine.decode_rounds import decode_rounds
from specpipe.engine.decode_specpipe import decode_specpipe
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sim.oracle_pipeline import OraclePipeline
from specpipe.spec_decode.draft_model import DraftModelSource

PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7]


class CheckedDraft(DraftModelSource):
    """Recomputes every proposal from scratch on the node's plain path and compares."""

    checked = 0

    def propose(self, rid, tree, rows, want, k):
        out = super().propose(rid, tree, rows, want, k)
        for n in want:
            path = list(tree.committed) + (tree.path_tokens(n) if n != tree.root_id else [])
            m = len(path)
            kv = self.model.make_kv_cache(m)
            logits = run_rows(self.model, kv, torch.tensor(path), list(range(m)), list(range(m)),
                              list(range(m)), np.tri(m, dtype=bool), [m - 1])
            expected = logits.log_softmax(-1).topk(k, -1)
            assert [t for t, _ in out[n]] == expected.indices[0].tolist(), f"node {n} at {tree.position(n)}"
            assert np.allclose([lp for _, lp in out[n]], expected.values[0].tolist(), atol=1e-4)
            self.checked += 1
        return out


@pytest.mark.parametrize("mode", ["specpipe", "tree"])
def test_tree_drafting_equals_plain_path_drafting(tiny_model_dir, mode):
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    target = build_stage(ckpt, StageSpec.whole(ckpt.config))
    draft = CheckedDraft(build_stage(ckpt, StageSpec(0, 3, True, True)), 512, "self:3")
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
        decode_specpipe(OraclePipeline(4, seq), req, draft, 4)
    else:
        decode_rounds(OraclePipeline(4, seq), req, draft, 3, 4)
    assert req.output_ids == seq[len(PROMPT):]
    assert draft.checked > 12 and req.stats.hits > 0
