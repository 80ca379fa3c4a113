"""The grammar package's parts alone: specs, compile errors and the cache, masks and their trip
over the wire, the draft's candidates, and the tool-call parser."""

from __future__ import annotations

import json

import pytest
import torch

from specpipe.distributed.wire import decode_rows_header, encode_rows
from specpipe.entrypoints.openai.tools import check_tools, forced_constraint, parse_tool_calls
from specpipe.entrypoints.openai.structured import BadConstraint
from specpipe.grammar import GrammarSpecError, StructuredOutput
from specpipe.grammar.bitmask import allowed, apply_masks, from_bytes
from specpipe.grammar.compiler import GrammarCompiler
from specpipe.grammar.matcher import RequestGrammar
from specpipe.messages import Rows
from specpipe.sampling import SamplingParams


@pytest.fixture(scope="module")
def tok(smollm2):
    from specpipe.loader.default_model import default_model_path
    from specpipe.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(default_model_path())


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, 49152)


def test_spec_checks():
    with pytest.raises(GrammarSpecError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(GrammarSpecError, match="exactly one"):
        StructuredOutput(regex="a", json_object=True)
    with pytest.raises(GrammarSpecError, match="not valid JSON"):
        StructuredOutput(json_schema="{nope")
    with pytest.raises(GrammarSpecError, match="JSON object"):
        StructuredOutput(json_schema=[1])
    assert StructuredOutput(json_schema={"a": 1}) == StructuredOutput(json_schema='{"a": 1}')  # one cache entry
    with pytest.raises(ValueError, match="StructuredOutput"):
        SamplingParams(structured={"type": "object"})


def test_compile_errors_name_the_problem_and_cache_hits(compiler):
    with pytest.raises(GrammarSpecError, match="unclosed group"):
        compiler.compile(StructuredOutput(regex="a(b"))
    with pytest.raises(GrammarSpecError, match="objectx"):
        compiler.compile(StructuredOutput(json_schema={"type": "objectx"}))
    with pytest.raises(GrammarSpecError, match="nothing_here"):
        compiler.compile(StructuredOutput(grammar="root ::= nothing_here"))
    spec = StructuredOutput(regex="[0-9]+")
    assert compiler.compile(spec) is compiler.compile(StructuredOutput(regex="[0-9]+"))


def test_masks_along_paths_and_forced_tokens(compiler, tok):
    g = RequestGrammar(compiler.compile(StructuredOutput(json_schema={
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}}})))
    ids = tok.encode('{"name":"x"}', add_special_tokens=False)
    refused = tok.encode("a", add_special_tokens=False)
    masks = g.masks([[], ids[:1], [999999], refused, None])
    ok = allowed(masks, 49152)
    assert ok[0, ids[0]] and ok[1, ids[1]] and not ok[0, tok.encode("a", add_special_tokens=False)[0]]
    assert ok[2].all() and ok[3].all() and ok[4].all()  # a refused path / a row gone: anything (never committed)
    # after '{' the key is forced: the draft's candidates get it first, forbidden ones are dropped
    forced = g.forced(ids[:1])
    assert forced is not None and tok.decode([forced]) == "name"
    cands = g.proposals(ids[:1], [(ids[1], -2.0), (refused[0], -0.1)], 4)
    assert cands == [(forced, 0.0)]  # the forced token first (here also the draft's), the forbidden one gone
    for t in ids:  # the committed state moves only on accept, and is left where it was by masks()
        assert g.accept(t) is None
    assert g.complete
    assert "refuses" in g.accept(ids[0])  # after the end nothing more is allowed


def test_masks_cross_the_wire_and_survive_pruning():
    masks = torch.tensor([[5, -1], [0, 1 << 62]], dtype=torch.long)
    rows = Rows(3, [10, 11, 12], [9, 10, 11], [4, 5, 6], torch.randn(3, 8), head_rows=[0, 2], masks=masks)
    header, tensors = encode_rows([rows])
    (got, shape, dtype), = decode_rows_header(header, hidden=8)
    assert got.masks.shape == (2, 2) and len(tensors) == 2 and torch.equal(tensors[1], masks)
    kept = rows.select([1, 2])  # head row 0 pruned: its mask goes with it
    assert kept.head_rows == [1] and torch.equal(kept.masks, masks[1:])
    logits = torch.zeros(2, 70)
    out = apply_masks(logits, masks)
    assert out[0].isfinite().nonzero().flatten().tolist() == [0, 2] + list(range(64, 70))
    assert not out[1].isfinite().any()  # its one allowed token (126) lies past these 70 logits
    assert apply_masks(torch.zeros(2, 128), masks)[1].isfinite().nonzero().flatten().tolist() == [126]
    assert from_bytes(b"\x01", 70).tolist() == [1, 0]  # llguidance's bytes, padded to whole words


def test_tool_choice_checks_and_forced_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    funcs, choice = check_tools(tools, {"type": "function", "function": {"name": "g"}})
    assert choice == "g" and set(funcs) == {"f", "g"}
    assert json.loads(forced_constraint(funcs, "g").json_schema)["properties"]["name"] == {"const": "g"}
    assert "anyOf" in json.loads(forced_constraint(funcs, "required").json_schema)
    assert forced_constraint(funcs, "auto") is None
    with pytest.raises(BadConstraint, match="'h'"):
        check_tools(tools, {"type": "function", "function": {"name": "h"}})
    with pytest.raises(BadConstraint, match="used twice"):
        check_tools(tools + tools[:1], None)


def test_parse_qwen_and_llama_tool_calls():
    funcs = {"get_weather": {}, "get_time": {}}
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = parse_tool_calls(text, funcs)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id != calls[1].id
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', funcs)  # Llama 3
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    _, calls = parse_tool_calls('{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
                                funcs)
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    for text in ("Paris is sunny.", '{"name": "unknown", "arguments": {}}', "<tool_call>{broken</tool_call>",
                 '{"city": "Paris"}'):
        assert parse_tool_calls(text, funcs) == (text, [])


def test_tool_streams_hold_only_what_may_be_a_call():
    from specpipe.entrypoints.openai.serving import _free_text_end

    assert _free_text_end("The weather is") == len("The weather is")
    assert _free_text_end("Checking <tool") == len("Checking ")  # could be the tag: held
    assert _free_text_end("Checking <tool_call>{\"na") == len("Checking ")
    assert _free_text_end("  <too") == 0 and _free_text_end('{"name"') == 0 and _free_text_end(" ") == 0
    assert _free_text_end("a < b") == len("a < b")


def test_cli_generate_regex(smollm2, capsys):
    from specpipe.entrypoints.cli import main

    assert main(["generate", "--quiet", "--json", "--max-tokens", "8", "--regex", "(yes|no)", "Answer yes or no:"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop"
    assert main(["generate", "--quiet", "--regex", "a(b", "x"]) == 2
    assert "unclosed group" in capsys.readouterr().err
