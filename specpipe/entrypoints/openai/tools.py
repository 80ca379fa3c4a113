"""OpenAI tools: checking `tools` and `tool_choice`, the constraint a forced call puts on the
output, the prompt for templates that cannot render tools, and parsing the calls a model wrote.

Calls are read in the formats of the families we ship: Qwen2.5's `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks (Hermes style), DeepSeek's, GLM-4.5's and MiniMax-M2's
own formats (tool_formats.py), and Llama 3.x's bare JSON
`{"name": ..., "parameters": {...}}` (one object, or several separated by ';' or in a list).
Small models often write the call as Markdown instead (Qwen2.5-Coder-1.5B does): a fenced block
```` ```json {"name": ..., "arguments": {...}} ``` ```` whose JSON names an offered function is a
call too, unless the server runs with --strict-tool-calls (`fenced=False`). A fenced block that
is not such a call (code, other JSON) stays content.
A forced call (`required`, or a named function) is constrained to one JSON object
`{"name": ..., "arguments": {...}}` that matches the function's parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from specpipe.entrypoints.openai.structured import BadConstraint
from specpipe.entrypoints.openai.tool_formats import parse_family_calls
from specpipe.grammar import GrammarSpecError, StructuredOutput

TOOL_TAG = "<tool_call>"  # Qwen2.5's (Hermes-style) call opener
FENCE = "```"  # a Markdown code fence: opens a fenced call (```json) when those are read
_FENCED = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.S)
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def check_tools(tools: Optional[list], tool_choice: Any) -> tuple[dict[str, dict], str]:
    """{name: parameters schema} of the tools, and the choice: "none", "auto", "required" or a
    function name. BadConstraint for a malformed tool or a choice naming a missing function."""
    funcs: dict[str, dict] = {}
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadConstraint("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if f["name"] in funcs:
            raise BadConstraint("tools", f"tools[{i}]: the function name {f['name']!r} is used twice")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadConstraint("tools", f"tools[{i}] ({f['name']}): parameters must be a JSON schema object")
        funcs[f["name"]] = params
    if tool_choice is None:
        return funcs, "auto" if funcs else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not funcs:
            raise BadConstraint("tool_choice", "tool_choice is 'required' but no tools were given")
        return funcs, tool_choice
    func = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = func.get("name") if isinstance(func, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise BadConstraint("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in funcs:
        raise BadConstraint("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools "
                                           f"({', '.join(funcs) or 'none given'})")
    return funcs, name


def forced_constraint(funcs: dict[str, dict], choice: str) -> Optional[StructuredOutput]:
    """The output constraint of a forced call (None for auto / none)."""
    if choice in ("none", "auto"):
        return None
    names = [choice] if choice != "required" else list(funcs)
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": n}, "arguments": funcs[n]}} for n in names]
    try:
        return StructuredOutput(json_schema=calls[0] if len(calls) == 1 else {"anyOf": calls})
    except GrammarSpecError as e:
        raise BadConstraint("tools", str(e)) from None


def tools_prompt(tools: list) -> str:
    """A system message describing the tools, for chat templates that do not render them
    (Qwen2.5's does; SmolLM2's does not). It asks for Qwen2.5's format."""
    listing = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _call_of(obj: Any, funcs: dict[str, dict]) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or obj.get("name") not in funcs:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, funcs: dict[str, dict], fenced: bool = True) -> tuple[str, list[ToolCall]]:
    """(content left, calls) from a model's answer; no calls when none parses as a call of a
    given function (then the whole text is content). `fenced`: read ```json fenced calls too.
    The DeepSeek, GLM and MiniMax formats are read first (tool_formats.py)."""
    family = parse_family_calls(text, funcs)
    if family is not None:
        return family[0], [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in family[1]]
    if "<tool_call>" in text:
        calls = []
        for m in _TAGGED.finditer(text):
            try:
                call = _call_of(json.loads(m.group(1)), funcs)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:text.index("<tool_call>")].strip(), calls
    body = text.strip()
    if body.startswith(("{", "[")):  # Llama 3.x: bare JSON, maybe several objects joined by ';'
        objs = _json_values(body)
        if objs is None:
            return text, []
        calls = [_call_of(o, funcs) for o in objs]
        if calls and all(c is not None for c in calls):
            return "", calls
    if fenced and FENCE in text:
        return _fenced_calls(text, funcs)
    return text, []


def _fenced_calls(text: str, funcs: dict[str, dict]) -> tuple[str, list[ToolCall]]:
    """Calls written as fenced blocks: each block whose whole body is JSON call(s) of offered
    functions becomes calls and leaves the content; every other block stays where it was."""
    calls, content, at = [], [], 0
    for m in _FENCED.finditer(text):
        objs = _json_values(m.group(1).strip())
        found = [_call_of(o, funcs) for o in objs or []]
        if found and all(c is not None for c in found):
            calls += found
            content.append(text[at:m.start()])
            at = m.end()
    if not calls:
        return text, []
    content.append(text[at:])
    return "".join(content).strip(), calls


def _json_values(body: str) -> Optional[list]:
    """The JSON values of `body`, one after another and optionally separated by ';' (a list's
    items count one by one); None unless the whole body is such values. Each value is read by the
    JSON decoder, so a ';' inside a string (an argument) is never taken for a separator."""
    decoder, objs, i = json.JSONDecoder(), [], 0
    while True:
        try:
            v, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return None
        objs.extend(v if isinstance(v, list) else [v])
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
        if i == len(body):
            return objs
