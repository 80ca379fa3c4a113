"""Structured output is exact under speculation: every mode at S = 1, 2, 4 (and pp-cb at S = 2)
commits the tokens plain constrained decoding (pp, S = 1) commits, greedy and with seeded sampling, for five
constraints on the embedded SmolLM2; every output matches its constraint; the draft never puts a
token the grammar forbids into the tree; each request's matcher is freed when it ends."""

from __future__ import annotations

import dataclasses

import pytest

from constraints import CONSTRAINTS, check_output
from specpipe import LLM, SamplingParams
from specpipe.grammar.matcher import RequestGrammar

GREEDY = SamplingParams(max_tokens=48)
SAMPLED = SamplingParams(temperature=0.9, seed=7, max_tokens=48)
RUNS = [("tree", 1), ("specpipe", 1), ("specpipe-db", 1), ("pp-cb", 2), ("tree", 2), ("specpipe", 2),
        ("specpipe-db", 2), ("pp", 4), ("tree", 4), ("specpipe", 4), ("specpipe-db", 4)]


def _requests():
    names = list(CONSTRAINTS)
    prompts = [CONSTRAINTS[n][0] for n in names] * 2
    params = [dataclasses.replace(base, structured=CONSTRAINTS[n][1]) for base in (GREEDY, SAMPLED) for n in names]
    return names * 2, prompts, params


def _generate(smollm2_path, mode, stages, draft="ngram"):
    names, prompts, params = _requests()
    with LLM(model=smollm2_path, stages=stages, mode=mode, draft=draft if mode in ("tree", "specpipe", "specpipe-db")
             else None, transport="inproc", tree_width=2) as llm:  # two branches a layer: trees, at half the rows
        outs = llm.generate(prompts, params, use_tqdm=False)
    return names, outs


@pytest.fixture(scope="module")
def smollm2_path(smollm2):
    from specpipe.loader.default_model import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def reference(smollm2_path):
    names, outs = _generate(smollm2_path, "pp", 1)
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop", (name, out.text)
        check_output(name, out.text)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mode,stages", RUNS)
def test_constrained_output_equal_in_every_mode(smollm2_path, reference, mode, stages):
    names, outs = _generate(smollm2_path, mode, stages)
    for name, out, ref in zip(names, outs, reference):
        assert out.token_ids == ref, (mode, stages, name, out.text)
        assert out.finish_reason == "stop"
        check_output(name, out.text)


def test_draft_model_source_constrained(smollm2_path, reference):
    """A model draft (the target's first layers) plus n-gram, at S = 2: same tokens."""
    names, outs = _generate(smollm2_path, "specpipe", 2, draft="self:10+ngram")
    assert [o.token_ids for o in outs] == reference


def test_tree_holds_only_allowed_tokens_and_matcher_is_freed(smollm2_path, monkeypatch):
    """Every node that enters a tree is one the grammar allows after its parent's path, and a
    finished request's matcher is closed."""
    from specpipe.spec_decode.tree import TokenTree

    grammars: list[RequestGrammar] = []
    made = RequestGrammar.__init__

    def track(self, compiled):
        made(self, compiled)
        grammars.append(self)

    checked = []
    expand = TokenTree.expand

    def checked_expand(tree, proposals):
        for g in grammars:
            if not g.closed and tree is getattr(g, "_test_tree", None):
                for n, cands in proposals.items():
                    if n in tree:
                        allowed = g.filter(tree.path_tokens(n), cands)
                        assert allowed == list(cands), (n, cands)
                        checked.append(n)
        return expand(tree, proposals)

    monkeypatch.setattr(RequestGrammar, "__init__", track)
    monkeypatch.setattr(TokenTree, "expand", checked_expand)
    from specpipe.engine.modes import base

    init = base.ModeState.__init__

    def bind(self, pid, req, source, width):
        init(self, pid, req, source, width)
        if req.grammar is not None:
            req.grammar._test_tree = self.tree

    monkeypatch.setattr(base.ModeState, "__init__", bind)
    names, prompts, params = _requests()
    with LLM(model=smollm2_path, stages=2, mode="specpipe", draft="ngram", transport="inproc", tree_width=4) as llm:
        outs = llm.generate(prompts[:5], params[:5], use_tqdm=False)
    assert checked, "no proposals were checked"
    assert all(g.closed for g in grammars) and len(grammars) == 5
    assert all(g.masks_made > 0 for g in grammars)
    for name, out in zip(names, outs):
        check_output(name, out.text)
