"""What a request's output must match: a JSON schema, any JSON object, a regex or a grammar.

A plain value (hashable, comparable) so that compiled grammars are cached by it, and checked when
it is made: a malformed spec is a `GrammarSpecError` naming what is wrong, before anything is
compiled or queued. Whether the grammar itself compiles is the compiler's check (compiler.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


class GrammarSpecError(ValueError):
    """A constraint that cannot be used; the message says what is wrong (a server answers 400)."""


KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a constraint larger than this is refused (1 MiB of schema or grammar text)


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the four kinds. `json_schema` is kept as compact JSON text (key order kept: llguidance emits properties in it),
    so two equal schemas share one compiled grammar; `grammar` is Lark or GBNF (as llama.cpp)."""

    json_schema: Optional[str] = None
    json_object: bool = False
    regex: Optional[str] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise GrammarSpecError(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", canonical_schema(self.json_schema))
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise GrammarSpecError(f"{k} must be a non-empty string")
            if v is not None and len(v) > MAX_SPEC_CHARS:
                raise GrammarSpecError(f"{k} is longer than {MAX_SPEC_CHARS} characters")

    @classmethod
    def of_schema(cls, schema: Any) -> "StructuredOutput":
        return cls(json_schema=schema)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> Optional[dict]:
        """The JSON schema the output must validate against (None for a regex or grammar)."""
        if self.json_schema is not None:
            return json.loads(self.json_schema)
        return {"type": "object"} if self.json_object else None


def canonical_schema(schema: Any) -> str:
    """A schema (dict, or JSON text of one) as canonical JSON text; GrammarSpecError if it is none."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise GrammarSpecError(f"json_schema is longer than {MAX_SPEC_CHARS} characters")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarSpecError(f"json_schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarSpecError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    text = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the properties' order
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarSpecError(f"json_schema is longer than {MAX_SPEC_CHARS} characters")
    return text
