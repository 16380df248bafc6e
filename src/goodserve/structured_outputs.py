"""A request's output grammar, named as in vLLM's StructuredOutputsParams: exactly one of a JSON
schema, any JSON object, a regex, a list of choices or an EBNF grammar (engine/grammar.py compiles it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from goodserve.errors import InvalidRequestError


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
