"""Harmony (gpt-oss) without a server: the parser on recorded answers, whole and streamed (cut
at every position), the chat template's rendering of every kind of message (text and token ids),
and the grammars of structured output and forced calls (which leave the reasoning free)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import llguidance
import pytest

from conftest import write_tiny_tokenizer
from harmony_model import HARMONY_TOKENS, add_harmony_tokenizer
from specpipe.entrypoints.openai.harmony import HarmonyParser, speaks_harmony, template_messages
from specpipe.entrypoints.openai.harmony_grammar import call_constraint, final_constraint, harmony_constraint
from specpipe.grammar import StructuredOutput
from specpipe.tokenizer.tokenizer import Tokenizer

FUNCS = {"get_weather": {"type": "object", "required": ["city"], "additionalProperties": False,
                         "properties": {"city": {"type": "string", "maxLength": 12}}},
         "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}}
CALL_HEAD = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"

# Recorded answers (what follows the prompt's <|start|>assistant) -> (reasoning, content, [(name, args)])
RECORDED = {
    "analysis_final": ("<|channel|>analysis<|message|>The user says hi. Answer briefly.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>",
                       ("The user says hi. Answer briefly.", "Hello! How can I help?", [])),
    "analysis_call": ("<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>"
                      + CALL_HEAD.format("get_weather") + '{"city":"Paris"}<|call|>',
                      ("Need the weather: call get_weather.", "", [("get_weather", {"city": "Paris"})])),
    "several_calls": ("<|channel|>analysis<|message|>Two things.<|end|>"
                      + CALL_HEAD.format("get_weather") + '{"city":"Rome"}<|call|>'
                      + CALL_HEAD.format("get_time") + '{"zone":"CET"}<|call|>',
                      ("Two things.", "", [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})])),
    # the template's order: the recipient before the channel, the content type a bare word
    "recipient_first": ('<|channel|>analysis<|message|>ok<|end|><|start|>assistant to=functions.get_time'
                        '<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>',
                        ("ok", "", [("get_time", {"zone": "UTC"})])),
    "truncated_analysis": ("<|channel|>analysis<|message|>Thinking about the que",
                           ("Thinking about the que", "", [])),
    "truncated_final": ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>The ans",
                        ("a", "The ans", [])),
    "truncated_call": ("<|channel|>analysis<|message|>a<|end|>" + CALL_HEAD.format("get_weather") + '{"city":"Pa',
                       ("a", '{"city":"Pa', [])),  # its text is kept as content: nothing is lost
    "truncated_header": ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin",
                         ("a", "", [])),
    "preamble": ("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>commentary<|message|>"
                 "Let me check.<|end|>" + CALL_HEAD.format("get_time") + "{}<|call|>",
                 ("r", "Let me check.", [("get_time", {})])),
    "two_analyses": ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two"
                     "<|end|><|start|>assistant<|channel|>final<|message|>done<|return|>",
                     ("one\n\ntwo", "done", [])),
    "unoffered_call": ("<|channel|>analysis<|message|>x<|end|>" + CALL_HEAD.format("launch") + '{"n":1}<|call|>',
                       ("x", '{"n":1}', [])),
    "final_only": ("<|channel|>final<|message|>Just this.<|return|>", (None, "Just this.", [])),
    "no_harmony": ("plain words", (None, "plain words", [])),
}


def _read(parser: HarmonyParser, pieces: list[str]):
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    calls = [(c.name, json.loads(c.arguments)) for c in parser.calls]
    return parser.reasoning_text, reasoning, content, calls


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_answers_whole_and_cut_at_every_position(name):
    text, (reasoning, content, calls) = RECORDED[name]
    whole = _read(HarmonyParser(FUNCS), [text])
    assert (whole[0], whole[2], whole[3]) == (reasoning, content, calls)
    assert whole[1] == (reasoning or "")
    for cut in range(1, len(text)):
        assert _read(HarmonyParser(FUNCS), [text[:cut], text[cut:]]) == whole, cut
    pieces = list(text)  # one character at a time: every marker split everywhere
    assert _read(HarmonyParser(FUNCS), pieces + [""]) == whole


def test_streamed_pieces_never_show_markup():
    text = RECORDED["preamble"][0]
    p = HarmonyParser(FUNCS)
    for ch in text:
        r, c = p.feed(ch)
        assert "<" not in r and "<" not in c and "|" not in r + c


def test_without_offered_functions_a_call_is_content():
    text, _ = RECORDED["analysis_call"]
    assert _read(HarmonyParser(), [text])[2:] == ('{"city":"Paris"}', [])


# -- rendering --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("harmony_tok")
    write_tiny_tokenizer(d)
    add_harmony_tokenizer(d)
    return Tokenizer.from_path(d)


def _system(effort: str = "medium", tools: bool = False) -> str:
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: 2024-06\nCurrent date: {time.strftime('%Y-%m-%d')}\n\nReasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message."
            + ("\nCalls to these tools must go to the commentary channel: 'functions'." if tools else "") + "<|end|>")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
          "parameters": {"type": "object", "required": ["city"], "properties": {
              "city": {"type": "string", "description": "The city"},
              "unit": {"type": "string", "enum": ["c", "f"]}}}}}]
TOOLS_TEXT = ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
              "namespace functions {\n\n// Weather in a city.\ntype get_weather = (_: {\n// The city\ncity: string,\n"
              'unit?: "c" | "f",\n}) => any;\n\n} // namespace functions<|end|>')


def _render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(template_messages(messages), **kw)


def test_renders_system_developer_and_user(tok):
    assert speaks_harmony(tok)
    text = _render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                   tools=TOOLS, reasoning_effort="high")
    assert text == _system("high", tools=True) + TOOLS_TEXT + "<|start|>user<|message|>hi<|end|><|start|>assistant"
    ids = tok.encode(text, add_special_tokens=False)
    specials = {tok.token_to_id(t): t for t in HARMONY_TOKENS}
    assert [specials[i] for i in ids if i in specials][:3] == ["<|start|>", "<|message|>", "<|end|>"]
    tail = [tok.token_to_id("<|start|>")] + tok.encode("assistant", add_special_tokens=False)
    assert ids[-len(tail):] == tail and tok.decode(ids, skip_special_tokens=False) == text


def test_renders_reasoning_tool_calls_and_results(tok):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    convo = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [call]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = _render(tok, convo)
    assert text == (_system() + "<|start|>user<|message|>weather?<|end|>"
                    "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>"
                    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                    '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
                    "<|start|>assistant")
    # once a final answer follows, the reasoning before the call is dropped, and the answer's own too
    done = convo + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"},
                    {"role": "user", "content": "thanks"}]
    text = _render(tok, done)
    assert "Call the tool." not in text and "easy" not in text
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
                         "<|start|>user<|message|>thanks<|end|><|start|>assistant")


def test_several_calls_render_one_per_message_each_followed_by_its_result(tok):
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": {}}}
             for i, n in enumerate(["get_weather", "get_time"])]
    convo = [{"role": "user", "content": "both"}, {"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "content": "r0", "tool_call_id": "c0"},
             {"role": "tool", "content": "r1", "tool_call_id": "c1"}]
    text = _render(tok, convo)
    assert text.index("to=functions.get_weather") < text.index('functions.get_weather to=assistant<|channel|>'
                                                               'commentary<|message|>"r0"') \
        < text.index("to=functions.get_time") < text.index('functions.get_time to=assistant<|channel|>commentary'
                                                          '<|message|>"r1"')


# -- constraints ------------------------------------------------------------------------------------

def _matcher(tok, spec: StructuredOutput):
    from specpipe.grammar.sandbox import grammar_text

    ll = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=300, eos_token=list(tok.eos_token_ids))
    grammar = grammar_text(spec.kind, spec.grammar)
    assert not llguidance.LLMatcher.validate_grammar(grammar, ll)
    return llguidance.LLMatcher(ll, grammar, log_level=0)


def _accepts(tok, spec, text: str) -> bool:
    m = _matcher(tok, spec)
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


def test_a_forced_call_constrains_the_call_and_not_the_reasoning(tok):
    spec = call_constraint(FUNCS, "get_weather")
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    for reasoning in ("", "<|channel|>analysis<|message|>anything {at all} <not a tag>\n\n<|end|><|start|>assistant"):
        assert _accepts(tok, spec, reasoning + head + '{"city":"Paris"}')
    assert not _accepts(tok, spec, head + '{"town":"Paris"}')  # the parameters' schema holds
    assert not _accepts(tok, spec, "<|channel|>final<|message|>Paris")  # no way round the call
    assert not _accepts(tok, spec, head.replace("get_weather", "get_time") + "{}")
    assert call_constraint(FUNCS, "auto") is None
    both = call_constraint(FUNCS, "required")
    assert _accepts(tok, both, head.replace("get_weather", "get_time") + '{"zone":"UTC"}')


def test_a_json_schema_holds_the_final_channel(tok):
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    spec = harmony_constraint(StructuredOutput(json_schema=schema))
    assert spec == final_constraint(schema)
    reasoning = "<|channel|>analysis<|message|>think<|end|><|start|>assistant"
    assert _accepts(tok, spec, reasoning + '<|channel|>final<|message|>{"n":3}')
    assert not _accepts(tok, spec, '<|channel|>final<|message|>{"n":"x"}')
    assert _accepts(tok, harmony_constraint(StructuredOutput(json_object=True)), "<|channel|>final<|message|>{}")
    regex = StructuredOutput(regex="a+")
    assert harmony_constraint(regex) is regex  # the client's own regex or grammar stays as given


def test_plain_templates_do_not_speak_harmony(tmp_path: Path):
    write_tiny_tokenizer(tmp_path)
    assert not speaks_harmony(Tokenizer.from_path(tmp_path))


def test_harmony_stop_tokens_are_return_and_call_never_end(tok):
    """<|end|> closes a message inside an answer: a tokenizer that lists it among its stop tokens
    (a GGUF marks it end-of-generation) stops on <|return|> and <|call|> instead."""
    ids = {t: tok.token_to_id(t) for t in ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")}
    assert set(tok.eos_token_ids) == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
    gguf_like = Tokenizer(tok._backend, bos_token_id=None, eos_token_ids=[ids["<|endoftext|>"], ids["<|end|>"]],
                          chat_template=None, source="test")
    assert gguf_like.eos_token_ids == (ids["<|endoftext|>"], ids["<|return|>"], ids["<|call|>"])
