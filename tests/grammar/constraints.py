"""The five constraints the structured-output tests run, and a check of each output."""

from __future__ import annotations

import json
import re

import jsonschema

from specpipe.grammar import StructuredOutput

NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
    "name": {"type": "string", "maxLength": 16},
    "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
        "city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ENUMS = {"type": "object", "additionalProperties": False, "required": ["color", "size"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}}
ARRAYS = {"type": "object", "additionalProperties": False, "required": ["primes", "tags"], "properties": {
    "primes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2,
               "maxItems": 4},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
DATE = r"(Monday|Tuesday|Friday), [0-9]{1,2} (May|June) 20[0-9]{2}"
SUM_GBNF = 'root ::= "(" num (" + " num)* ") = " num\nnum ::= [1-9] [0-9]?\n'
SUM_RE = re.compile(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\) = [1-9][0-9]?")

CONSTRAINTS = {  # name: (prompt, constraint)
    "nested": ("Give a person's name and address as JSON.", StructuredOutput(json_schema=NESTED)),
    "enums": ("Pick a color and a size, as JSON.", StructuredOutput(json_schema=ENUMS)),
    "arrays": ("List two to four primes and a few tags, as JSON.", StructuredOutput(json_schema=ARRAYS)),
    "regex": ("When is the meeting?", StructuredOutput(regex=DATE)),
    "grammar": ("Write a small sum and its result.", StructuredOutput(grammar=SUM_GBNF)),
}


def check_output(name: str, text: str) -> None:
    """The output matches its constraint (JSON ones validate with jsonschema)."""
    spec = CONSTRAINTS[name][1]
    if spec.schema() is not None:
        jsonschema.validate(json.loads(text), spec.schema())
    elif name == "regex":
        assert re.fullmatch(DATE, text), text
    else:
        assert SUM_RE.fullmatch(text), text
