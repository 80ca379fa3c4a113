"""A request body's output constraint: `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_grammar`, or the one `tool_choice` forces (tools.py).
At most one may be given; a malformed one is a `BadConstraint` naming the field (a 400)."""

from __future__ import annotations

from typing import Any, Optional

from specpipe.grammar import GrammarSpecError, StructuredOutput


class BadConstraint(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def from_response_format(rf: dict) -> Optional[StructuredOutput]:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise BadConstraint("response_format", "response_format json_schema needs "
                                "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        if js.get("strict") not in (None, True, False):
            raise BadConstraint("response_format", "json_schema.strict must be a boolean")
        try:
            return StructuredOutput(json_schema=js["schema"])  # strict or not: the output always matches
        except GrammarSpecError as e:
            raise BadConstraint("response_format", str(e)) from None
    raise BadConstraint("response_format", f"response_format type {kind!r} is not one of text, json_object, "
                                           f"json_schema")


def constraint_of(body: Any, forced: Optional[StructuredOutput] = None) -> Optional[StructuredOutput]:
    """The one constraint the body asks for (None: free text). `forced`: tool_choice's."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and not isinstance(rf, dict):
        rf = rf.model_dump(by_alias=True, exclude_none=True)
    if rf:
        c = from_response_format(rf)
        if c is not None:
            found.append(("response_format", c))
    for name, make in (("guided_json", lambda v: StructuredOutput(json_schema=v)),
                       ("guided_regex", lambda v: StructuredOutput(regex=v)),
                       ("guided_grammar", lambda v: StructuredOutput(grammar=v))):
        v = getattr(body, name, None)
        if v is not None:
            try:
                found.append((name, make(v)))
            except GrammarSpecError as e:
                raise BadConstraint(name, str(e)) from None
    if forced is not None:
        found.append(("tool_choice", forced))
    if len(found) > 1:
        raise BadConstraint(found[1][0], f"give one output constraint; got {', '.join(n for n, _ in found)}")
    return found[0][1] if found else None


def param_of(body: Any, forced: bool) -> str:
    """The field a compile error is blamed on."""
    for name in ("guided_json", "guided_regex", "guided_grammar"):
        if getattr(body, name, None) is not None:
            return name
    return "tool_choice" if forced else "response_format"
