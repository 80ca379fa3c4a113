"""Tool calls in the formats of the big MoE families (issue 59), as their chat templates teach
them, read into the same `ToolCall`s as the JSON formats in tools.py:

  DeepSeek V3 / R1   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                     ```json
                     {"city": "Paris"}
                     ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  DeepSeek V3.1      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>...
  GLM-4.5 / 4.6      <tool_call>NAME
                     <arg_key>city</arg_key>
                     <arg_value>Paris</arg_value>
                     </tool_call>
  MiniMax-M2         <minimax:tool_call>
                     <invoke name="NAME">
                     <parameter name="city">Paris</parameter>
                     </invoke>
                     </minimax:tool_call>

GLM's and MiniMax's values are text: a value whose parameter the schema types as a string stays
text, any other is read as JSON where it parses (a number, a list, an object), else kept as text.
Every call must name an offered function; one that does not, or that does not parse, makes the
whole answer content (as tools.py does), so nothing a model wrote is lost.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

DEEPSEEK_OPEN = "<｜tool▁calls▁begin｜>"
GLM_ARG = "<arg_key>"
MINIMAX_OPEN = "<minimax:tool_call>"
OPENERS = (DEEPSEEK_OPEN, MINIMAX_OPEN)  # text from one of these is held back when streaming
# The markup the server reads (calls, and reasoning): where a tokenizer makes one of these a
# special token, its text must stay in the output all the same (as vLLM's parsers decode it).
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
          "</arg_value>", DEEPSEEK_OPEN, "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
          "<｜tool▁sep｜>", MINIMAX_OPEN, "</minimax:tool_call>")

_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.S)
_DEEPSEEK_V3_ARGS = re.compile(r"\s*```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)
_GLM_CALL = re.compile(r"<tool_call>\s*([^<\n]*?)\s*((?:<arg_key>.*?)?)\s*(?:</tool_call>|$)", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_MINIMAX_BLOCK = re.compile(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|$)", re.S)
_MINIMAX_INVOKE = re.compile(r"<invoke\s+name=\"?([^\">]+)\"?\s*>(.*?)(?:</invoke>|$)", re.S)
_MINIMAX_PARAM = re.compile(r"<parameter\s+name=\"?([^\">]+)\"?\s*>(.*?)</parameter>", re.S)


def markup_ids(tokenizer) -> frozenset[int]:
    """The special tokens of `tokenizer` that are markup the server reads (MARKUP)."""
    return frozenset(i for i in tokenizer.special_ids() if tokenizer.decode([i], skip_special_tokens=False) in MARKUP)


def family_format(text: str) -> Optional[str]:
    """Which family's call format `text` holds, if any: "deepseek", "glm" or "minimax"."""
    if DEEPSEEK_OPEN in text or "<｜tool▁call▁begin｜>" in text:
        return "deepseek"
    if MINIMAX_OPEN in text:
        return "minimax"
    if "<tool_call>" in text and (GLM_ARG in text or _glm_bare_name(text)):
        return "glm"
    return None


def _glm_bare_name(text: str) -> bool:
    """A GLM call without arguments: `<tool_call>NAME</tool_call>` (not Hermes' JSON)."""
    m = re.search(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S)
    return m is not None and re.fullmatch(r"[\w.\-]+", m.group(1) or "") is not None


def parse_family_calls(text: str, funcs: dict[str, dict]) -> Optional[tuple[str, list[tuple[str, dict]]]]:
    """(content before the calls, [(name, arguments)]) when `text` holds calls in one of the
    families' formats, all of offered functions; None when it holds none or any fails to parse."""
    kind = family_format(text)
    if kind is None:
        return None
    reader = {"deepseek": _deepseek, "glm": _glm, "minimax": _minimax}[kind]
    opener = {"deepseek": DEEPSEEK_OPEN if DEEPSEEK_OPEN in text else "<｜tool▁call▁begin｜>",
              "glm": "<tool_call>", "minimax": MINIMAX_OPEN}[kind]
    calls = reader(text, funcs)
    if not calls or any(c is None or c[0] not in funcs for c in calls):
        return None
    return text[:text.index(opener)].strip(), calls


def _deepseek(text: str, funcs: dict[str, dict]) -> list:
    out = []
    for head, body in _DEEPSEEK_CALL.findall(text):
        head = head.strip()
        if head == "function":  # V3: `function<｜tool▁sep｜>NAME\n```json\n{...}\n````
            name, _, rest = body.partition("\n")
            m = _DEEPSEEK_V3_ARGS.match(rest)
            args = _json_object(m.group(1) if m else rest)
            out.append((name.strip(), args) if args is not None else None)
        else:  # V3.1: `NAME<｜tool▁sep｜>{...}`
            args = _json_object(body)
            out.append((head, args) if args is not None else None)
    return out


def _glm(text: str, funcs: dict[str, dict]) -> list:
    out = []
    for name, args in _GLM_CALL.findall(text):
        props = _properties(funcs.get(name.strip()))
        out.append((name.strip(), {k.strip(): _typed(v, props.get(k.strip())) for k, v in _GLM_ARG.findall(args)}))
    return out


def _minimax(text: str, funcs: dict[str, dict]) -> list:
    out = []
    for block in _MINIMAX_BLOCK.findall(text):
        for name, params in _MINIMAX_INVOKE.findall(block):
            props = _properties(funcs.get(name.strip()))
            out.append((name.strip(), {k.strip(): _typed(_strip_newlines(v), props.get(k.strip()))
                                       for k, v in _MINIMAX_PARAM.findall(params)}))
    return out


def _strip_newlines(v: str) -> str:
    """MiniMax writes a value on its own lines sometimes: one leading and trailing newline go."""
    return v.removeprefix("\n").removesuffix("\n")


def _properties(schema: Optional[dict]) -> dict:
    props = (schema or {}).get("properties")
    return props if isinstance(props, dict) else {}


def _typed(value: str, schema: Any) -> Any:
    """A text value as its parameter's schema types it."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _json_object(text: str) -> Optional[dict]:
    try:
        v = json.loads(text.strip())
    except ValueError:
        return None
    return v if isinstance(v, dict) else None
