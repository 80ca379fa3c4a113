"""Reasoning through the live chat endpoint (the official openai client): a model whose template
is a reasoning model's writes <think>…</think> (the tiny model is made to, with a regex
constraint); the reasoning comes back as message.reasoning_content and, streamed, as
delta.reasoning_content, the answer alone as content; chat_template_kwargs reach the template."""

from __future__ import annotations

import re

import openai
import pytest

from live_app import KEY, NAME

THOUGHT = "<think>[a-z ]{4,12}</think>\n\n[a-z]{2,6}"  # what the model is made to write
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(thinking_server):
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ask(client, **kw):
    return client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0,
                                          extra_body={"guided_regex": THOUGHT, **kw.pop("extra_body", {})}, **kw)


def test_reasoning_comes_apart_from_the_answer_whole_and_streamed(client):
    msg = _ask(client).choices[0].message
    assert re.fullmatch("[a-z ]{4,12}", msg.reasoning_content), msg
    assert re.fullmatch("[a-z]{2,6}", msg.content), msg
    reasoning, content = "", ""
    for chunk in _ask(client, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            assert "<think>" not in content and "</think>" not in reasoning + content
    assert (reasoning, content) == (msg.reasoning_content, msg.content)


def test_reasoning_with_tools_streamed(client):
    """The tool-call stream (held text, calls at the end) splits the reasoning off too."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    whole = _ask(client, tools=tools).choices[0].message
    reasoning, content = "", ""
    for chunk in _ask(client, tools=tools, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content) and whole.reasoning_content


def test_chat_template_kwargs_reach_the_template(client):
    plain = _ask(client).usage.prompt_tokens
    off = _ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    assert off > plain  # the template rendered the empty <think></think> into the prompt
    bad = openai.BadRequestError
    with pytest.raises(bad, match="chat_template_kwargs"):
        _ask(client, extra_body={"chat_template_kwargs": {"messages": []}})
