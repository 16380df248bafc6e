"""A request's output grammar, named as in vLLM's StructuredOutputsParams: exactly one of a JSON
schema, any JSON object, a regex, a list of choices or an EBNF grammar (engine/frontend/grammar.py compiles it).

Its size and a schema's nesting are bounded here, before anything compiles it: a compile's time grows
with both (a 20,000-value enum: 1.1 s on one core; a schema nested 450 objects deep: 13 s), and a
schema nested a few hundred levels fails to cross to the engine's process (pickle's recursion limit).
OpenAI bounds its schemas tighter still (10 levels of objects, 120,000 characters of names and values).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from goodserve.errors import InvalidRequestError

MAX_SCHEMA_DEPTH = 64  # JSON levels of a schema: {"properties": {"a": ...}} is two
MAX_GRAMMAR_BYTES = 128 << 10  # UTF-8 bytes of a schema, regex, grammar or choice list (~0.35 s to compile)


_SCALARS = frozenset({str, int, float, bool, type(None)})


def json_depth(value: object, limit: int) -> int:
    """How deep value's lists and objects nest (a scalar: 0), counted up to limit + 1 at most. A level
    at a time, not recursively, so a value nested past Python's recursion limit is measured too; a list
    of scalars (a prompt's 100,000 token ids) is passed over in C."""
    depth, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level and depth <= limit:
        depth += 1
        deeper = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            if not _SCALARS.issuperset(map(type, children)):
                deeper.extend(child for child in children if isinstance(child, (dict, list)))
        level = deeper
    return depth


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (object or its text)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF dialect, as xgrammar and vLLM take it)

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{name} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("json must be a JSON schema (an object)")
        self._check_bounds()

    def _check_bounds(self) -> None:
        if isinstance(self.json, dict):  # before json.dumps (self.key) walks it recursively
            _check_schema_depth(self.json)
        kind, source = self.key
        what = {"json": "the JSON schema", "regex": "the regex", "choice": "the choice list"}.get(kind, "the grammar")
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise InvalidRequestError(f"{what} has {size} bytes, more than the {MAX_GRAMMAR_BYTES} this server "
                                      "compiles: make it smaller")
        if isinstance(self.json, str):
            try:
                schema = json.loads(source)
            except (ValueError, RecursionError):
                raise InvalidRequestError("the JSON schema is not valid JSON") from None
            _check_schema_depth(schema)

    @property
    def key(self) -> tuple[str, str]:
        """What the grammar is, as a hashable value: the compile cache's key."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order is the output order
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar


def _check_schema_depth(schema: object) -> None:
    if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep: flatten it")
