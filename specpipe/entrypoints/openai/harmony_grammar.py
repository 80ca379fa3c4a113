"""Structured output and forced tool calls under Harmony (harmony.py): the constraint holds the
channel that carries the answer or the call, and leaves the reasoning free.

A JSON schema (response_format, guided_json) or a forced call becomes one llguidance Lark grammar
over the whole answer, the Harmony markup as special tokens:

    start:    analysis? final                 (or: analysis? call)
    analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"
    final:    <|channel|> "final" <|message|> %json{schema}
    call:     <|channel|> "commentary to=functions.NAME " <|constrain|> "json" <|message|> %json{parameters}

so the model may reason first, as it was trained to, and what follows is the answer or the call
the request asked for, nothing else. The grammar ends with the JSON: the request stops there
(structured output's rule), before the <|return|> or <|call|> the model would write. JSON is
written as the other constraints write it (grammar/sandbox.py's JSON_OPTIONS, which a schema's
own "x-guidance" overrides). A regex or grammar the client gives is its own and stays as it is.
"""

from __future__ import annotations

import json
from typing import Optional

from specpipe.entrypoints.openai.structured import BadConstraint
from specpipe.grammar import GrammarSpecError, StructuredOutput
from specpipe.grammar.sandbox import JSON_OPTIONS

_HEAD = """%llguidance {}
start: analysis? ANSWER
analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"
THOUGHT: /(?s:.*)/
"""


def _json(schema: dict) -> str:
    """A Lark %json rule body for `schema`, with the server's JSON options."""
    options = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _grammar(answer_rules: list[str], param: str) -> StructuredOutput:
    try:
        return StructuredOutput(grammar=_HEAD.replace("ANSWER", "answer") + "\n".join(answer_rules) + "\n")
    except GrammarSpecError as e:  # too long
        raise BadConstraint(param, str(e)) from None


def final_constraint(schema: dict) -> StructuredOutput:
    """The final channel holds JSON that matches `schema`."""
    return _grammar(['answer: <|channel|> "final" <|message|> json', f"json: {_json(schema)}"], "response_format")


def call_constraint(funcs: dict[str, dict], choice: str) -> Optional[StructuredOutput]:
    """A forced call (`required`: any offered function; a name: that one) as a commentary
    message to it with arguments that match its parameters; None for auto and none."""
    if choice in ("none", "auto"):
        return None
    names = list(funcs) if choice == "required" else [choice]
    rules = ["answer: " + " | ".join(f"call{i}" for i in range(len(names)))]
    for i, name in enumerate(names):
        head = json.dumps(f"commentary to=functions.{name} ")
        rules.append(f'call{i}: <|channel|> {head} <|constrain|> "json" <|message|> args{i}')
        rules.append(f"args{i}: {_json(funcs[name])}")
    return _grammar(rules, "tools")


def harmony_constraint(structured: Optional[StructuredOutput]) -> Optional[StructuredOutput]:
    """A request's constraint as Harmony's: JSON ones go to the final channel."""
    if structured is None or structured.kind not in ("json_schema", "json_object"):
        return structured
    return final_constraint(structured.schema())
