"""Chat templates in the style of the new families render in our sandbox exactly as transformers
renders them: a Qwen3-style template (thinking switch, reasoning split off past turns, a
namespace walked over the reversed messages, tool calls as JSON) and a Gemma-style one (BOS,
the system prompt folded into the first user turn, `model` as the assistant's role, list contents,
alternation enforced by raise_exception). The templates are written here, with the constructs
the published ones use; the real files come with the models."""

from __future__ import annotations

import json
import shutil

import pytest

from specpipe.tokenizer.tokenizer import Tokenizer, TokenizerError

QWEN3_STYLE = """{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and message.content is string and not message.content.startswith('<tool_response>') and ns.last_query == messages|length - 1 %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

GEMMA_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = (messages[0]['content'] if messages[0]['content'] is string else messages[0]['content'][0]['text']) + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "user", "content": [{"type": "text", "text": "  And 3 + 3?  "}]},
]


def with_template(tiny_llama_dir, tmp_path, template: str):
    d = tmp_path / "tok"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / f, d / f)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template, "bos_token": "<|im_start|>"}))
    from transformers import AutoTokenizer

    return Tokenizer.from_path(d), AutoTokenizer.from_pretrained(d)


def qwen_text(conversation):  # the Qwen3 style takes string contents only
    return [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
            for m in conversation]


@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_style_template_and_thinking_switch(tiny_llama_dir, tmp_path, thinking):
    ours, theirs = with_template(tiny_llama_dir, tmp_path, QWEN3_STYLE)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    for conversation in (qwen_text(CONVERSATION), qwen_text(CONVERSATION[:3])):
        got = ours.apply_chat_template(conversation, **kwargs)
        assert got == theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **kwargs)
        assert got.endswith("<think>\n\n</think>\n\n") == (thinking is False)
    assert '{"name": "add", "arguments": {"a": 2, "b": 2}}' in got


def test_gemma_style_template(tiny_llama_dir, tmp_path):
    ours, theirs = with_template(tiny_llama_dir, tmp_path, GEMMA_STYLE)
    got = ours.apply_chat_template(CONVERSATION)
    assert got == theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert got.startswith("<|im_start|><start_of_turn>user\nBe brief.\n\nWhat is 2 + 2?<end_of_turn>")
    assert got.endswith("And 3 + 3?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "hi"}])
