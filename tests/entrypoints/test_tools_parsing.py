"""Reading the calls a model wrote (entrypoints/openai/tools.py): a ';' inside an argument is
part of the argument (issue 58, finding 6: a forced call whose argument held one came back as
text), while ';' between bare JSON calls (Llama 3.x) still separates them."""

from __future__ import annotations

import json

import pytest

from specpipe.entrypoints.openai.tools import parse_tool_calls

FUNCS = {"run": {"type": "object"}}


def test_a_semicolon_inside_an_argument_stays_in_it():
    content, calls = parse_tool_calls('{"name": "run", "arguments": {"cmd": "ls; pwd"}}', FUNCS)
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"cmd": "ls; pwd"}]


def test_bare_calls_joined_by_semicolons_are_each_read():
    text = '{"name": "run", "parameters": {"cmd": "a"}}; {"name": "run", "parameters": {"cmd": "b;c"}}'
    _, calls = parse_tool_calls(text, FUNCS)
    assert [json.loads(c.arguments)["cmd"] for c in calls] == ["a", "b;c"]


@pytest.mark.parametrize("text", ['{"name": "run"} and more', '{"name": "run", "arguments": {', '{"name": "other"}'])
def test_anything_else_is_content(text):
    assert parse_tool_calls(text, FUNCS) == (text, [])
