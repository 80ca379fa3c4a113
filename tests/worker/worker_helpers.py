"""Stage workers of the tiny model and the steps the stage-check tests drive through them."""

from __future__ import annotations

import copy

import pytest
import torch

from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.messages import NO_PARENT, Admit, Control, Prune, Rows
from specpipe.model.stage import build_stage
from specpipe.sampling import SamplingParams
from specpipe.worker.stage_worker import StageWorker

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [5, 17, 33, 90, 5, 17, 33]


@pytest.fixture(scope="module")
def stages(tiny_llama_dir):
    """Builds (first, last) stage workers of the tiny model afresh, two layers each."""
    ckpt = open_checkpoint(tiny_llama_dir)
    n = ckpt.config.num_layers

    def make(blocks: int = 16) -> tuple[StageWorker, StageWorker]:
        return (StageWorker(build_stage(ckpt, StageSpec(0, n // 2, True, False)), blocks, BLOCK, horizon=1),
                StageWorker(build_stage(ckpt, StageSpec(n // 2, n, False, True)), blocks, BLOCK, horizon=2))
    return make


def state(w: StageWorker):
    t = w.slots
    return copy.deepcopy((t.requests, t.cached, dict(t.readers), t.lost, t.clock, sorted(t.pool._free), t.idle,
                          sorted(w.sampling), w.stats.steps)), w.kv.k.clone().view(torch.uint8)  # bytes: torch.empty holds NaNs


def assert_refused(w: StageWorker, error, source: str, control: Control, rows: list[Rows], match: str = ""):
    before, k = state(w)
    with pytest.raises(error, match=match) as e:
        w.step(control, rows)
    assert e.value.source == source
    after, k2 = state(w)
    assert after == before and torch.equal(k, k2), "a refused step changed the stage"


def prompt_rows(rid: int = 0) -> Rows:
    n = len(PROMPT)
    return Rows(rid, list(range(n)), [NO_PARENT] + list(range(n - 1)), list(range(n)), torch.tensor(PROMPT),
                head_rows=[n - 1])


def decode(first: StageWorker, last: StageWorker, rid: int, steps: int) -> list[int]:
    """Greedy pp decoding through the two stages (node id = position)."""
    n = len(PROMPT)
    control = Control(admit=[Admit(rid, GREEDY)], prune=[Prune(rid, commit=list(range(n)))])
    hidden = first.step(control, [prompt_rows(rid)])
    tokens = []
    for _ in range(steps):
        (res,) = last.step(control, hidden)
        tok, pos = res.tokens[-1], n + len(tokens)
        tokens.append(tok)
        control = Control(prune=[Prune(rid, commit=[pos])])
        hidden = first.step(control, [Rows(rid, [pos], [pos - 1], [pos], torch.tensor([tok]))])
    release = Control(release=[rid])
    first.step(release, [])
    last.step(release, [])
    return tokens
