"""The big MoE families' tool-call formats (entrypoints/openai/tool_formats.py), read through
tools.parse_tool_calls from texts written exactly as each family's chat template renders an
assistant's calls (DeepSeek V3 / V3.1, GLM-4.5, MiniMax-M2)."""

from __future__ import annotations

import json

import pytest

from specpipe.entrypoints.openai.tools import parse_tool_calls

FUNCS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "units": {"type": "array"}}},
         "now": {"type": "object", "properties": {}}}

DEEPSEEK_V3 = ("Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n'
               "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
DEEPSEEK_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                "<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
GLM = ("Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>")
MINIMAX = ('Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
           '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>')


@pytest.mark.parametrize("text,content", [(DEEPSEEK_V3, "Let me look."), (DEEPSEEK_V31, ""), (GLM, "Let me look."),
                                          (MINIMAX, "Let me look.")], ids=["deepseek_v3", "deepseek_v31", "glm45",
                                                                           "minimax_m2"])
def test_each_family_format_is_read_into_calls(text, content):
    got, calls = parse_tool_calls(text, FUNCS)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                 ("now", {})]


def test_values_follow_the_schema_types():
    # A string parameter keeps its text even when it looks like JSON; others are read as JSON.
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n<arg_key>units</arg_key>\n"
            '<arg_value>["c", "f"]</arg_value>\n</tool_call>')
    _, calls = parse_tool_calls(text, FUNCS)
    assert json.loads(calls[0].arguments) == {"city": "123", "units": ["c", "f"]}
    text = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">\nNew\nYork\n</parameter>\n'
            '</invoke>\n</minimax:tool_call>')
    _, calls = parse_tool_calls(text, FUNCS)
    assert json.loads(calls[0].arguments) == {"city": "New\nYork"}


@pytest.mark.parametrize("text", [
    DEEPSEEK_V3.replace("get_weather", "delete_all"),  # not an offered function
    GLM.replace("now", "reboot"),
    MINIMAX.replace('"now"', '"reboot"'),
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": <｜tool▁call▁end｜>',  # broken JSON
])
def test_a_call_that_does_not_parse_leaves_everything_content(text):
    assert parse_tool_calls(text, FUNCS) == (text, [])


def test_hermes_calls_are_still_read_as_json():
    text = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    _, calls = parse_tool_calls(text, FUNCS)
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")]


def test_special_markup_tokens_keep_their_text(tmp_path):
    """Where a tokenizer makes the markup special tokens (GLM-4.5's <tool_call> may be), a chat
    answer's detokenizer keeps their text, while other specials (end of turn) are still dropped."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer

    from conftest import write_tiny_tokenizer
    from specpipe.entrypoints.openai.tool_formats import markup_ids
    from specpipe.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

    write_tiny_tokenizer(tmp_path)
    raw = RawTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_path(tmp_path)
    keep = markup_ids(tok)
    assert len(keep) == 2
    ids = tok.encode("ok<tool_call>now</tool_call><|im_end|>", add_special_tokens=False)

    def text(d: IncrementalDetokenizer) -> str:
        return "".join(d.add(i) for i in ids) + d.flush()

    assert text(IncrementalDetokenizer(tok)) == "oknow"
    assert text(IncrementalDetokenizer(tok, keep=keep)) == "ok<tool_call>now</tool_call>"
