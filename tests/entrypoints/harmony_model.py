"""A gpt-oss-like tokenizer and chat template for the Harmony tests, made offline: the tiny
byte-level tokenizer (tests/conftest.py) with Harmony's special tokens added, and gpt-oss's chat
template as published with the model (written here from it and the Harmony spec; the built-in
browser and python tools' text is left out: nothing here offers them).

openai-harmony, OpenAI's own renderer, is not the reference here: it loads the o200k_base
vocabulary by download at run time, and checks the file's hash (so no small local vocabulary
stands in for it); CI has no network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

GPT_OSS_TEMPLATE = r"""
{%- macro render_typescript_type(spec) -%}
    {%- if spec.type == "array" -%}
        {%- if spec['items'] and spec['items'].type in ("string", "boolean") -%}{{- spec['items'].type + "[]" }}
        {%- elif spec['items'] and spec['items'].type in ("number", "integer") -%}{{- "number[]" }}
        {%- else -%}{{- "any[]" }}{%- endif -%}
    {%- elif spec.type == "string" -%}
        {%- if spec.enum -%}{{- '"' + spec.enum|join('" | "') + '"' }}{%- else -%}{{- "string" }}{%- endif -%}
    {%- elif spec.type in ("number", "integer") -%}{{- "number" }}
    {%- elif spec.type == "boolean" -%}{{- "boolean" }}
    {%- elif spec.type == "object" -%}{{- "object" }}
    {%- else -%}{{- "any" }}{%- endif -%}
{%- endmacro -%}

{%- macro render_tool_namespace(namespace_name, tools) -%}
    {{- "## " + namespace_name + "\n\n" }}
    {{- "namespace " + namespace_name + " {\n\n" }}
    {%- for tool in tools %}
        {%- set tool = tool.function %}
        {{- "// " + (tool.description or "") + "\n" }}
        {{- "type " + tool.name + " = " }}
        {%- if tool.parameters and tool.parameters.properties %}
            {{- "(_: {\n" }}
            {%- for param_name, param_spec in tool.parameters.properties.items() %}
                {%- if param_spec.description %}{{- "// " + param_spec.description + "\n" }}{%- endif %}
                {{- param_name }}
                {%- if param_name not in (tool.parameters.required or []) -%}{{- "?" }}{%- endif -%}
                {{- ": " + render_typescript_type(param_spec) }}
                {%- if param_spec.default is defined -%}{{- ", // default: " + param_spec.default|tojson }}{%- endif -%}
                {{- ",\n" }}
            {%- endfor %}
            {{- "}) => any;\n\n" }}
        {%- else -%}
            {{- "() => any;\n\n" }}
        {%- endif -%}
    {%- endfor %}
    {{- "} // namespace " + namespace_name }}
{%- endmacro -%}

{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\n" }}
    {{- "Knowledge cutoff: 2024-06\n" }}
    {{- "Current date: " + strftime_now("%Y-%m-%d") + "\n\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\n\n" }}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
    {%- if tools -%}
        {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
    {%- endif -%}
{%- endmacro -%}

{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}

{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}

{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}
        {{- "# Instructions\n\n" + developer_message + "\n\n" }}
    {%- endif %}
    {%- if tools -%}
        {{- "# Tools\n\n" + render_tool_namespace("functions", tools) }}
    {%- endif -%}
    {{- "<|end|>" }}
{%- endif %}

{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "content" in message and ("<|channel|>analysis<|message|>" in message.content
                                         or "<|channel|>final<|message|>" in message.content) %}
            {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {%- set future_final_message = namespace(found=false) %}
            {%- for future_message in loop_messages[loop.index:] %}
                {%- if future_message.role == 'assistant' and "tool_calls" not in future_message %}
                    {%- set future_final_message.found = true %}
                {%- endif %}
            {%- endfor %}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") }}
            {%- elif message.content and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- elif message.thinking and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but no assistant message with a tool call before it!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
""".strip()


def add_harmony_tokenizer(directory: Path) -> dict[str, int]:
    """Turn the tiny tokenizer in `directory` into a gpt-oss-like one: Harmony's special tokens,
    gpt-oss's template, and its stop tokens (<|return|>, <|call|>, <|endoftext|>). Returns the
    special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in HARMONY_TOKENS + ["<|endoftext|>"]}
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(chat_template=GPT_OSS_TEMPLATE, eos_token="<|return|>")
    cfg_path.write_text(json.dumps(cfg))
    gen_path = directory / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen["eos_token_id"] = [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]
    gen_path.write_text(json.dumps(gen))
    return ids


def harmony_model(tiny_model_dir, tmp_path: Path) -> Path:
    """A copy of the tiny llama that speaks Harmony (its tokenizer and template)."""
    src = tiny_model_dir("llama", num_hidden_layers=2, max_position_embeddings=1024)
    dst = tmp_path / "harmony"
    shutil.copytree(src, dst)
    add_harmony_tokenizer(dst)
    return dst
