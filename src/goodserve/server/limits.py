"""Bounds on what one request may send, in one place, and the check for text that is not Unicode.

Cheap-looking fields can be expensive: every stop string is matched against every new token's
text, every message goes through the chat template. A request past a bound is a 400 naming the
field and the bound (docs/serving.md lists them), before it costs anything.
"""

from __future__ import annotations

import json
import re
from typing import Annotated

from pydantic import Field
from pydantic_core import PydanticCustomError

from goodserve.errors import InvalidRequestError
from goodserve.structured_outputs import MAX_SCHEMA_DEPTH, json_depth

MAX_STOP_STRINGS = 64  # OpenAI allows 4; vLLM has no bound
MAX_STOP_STRING_CHARS = 1024  # longer stop strings also hold back that much streamed text
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256  # text parts in one message
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries
MAX_NAME_CHARS = 256  # model, user, a message's name
# Nesting of a request body's JSON: a schema in it is nested less (structured_outputs.py), and the
# framing around it (tools[].function.parameters) takes a few levels. Deeper bodies would hit Python's
# recursion limit in the code that walks, copies or pickles them.
MAX_BODY_DEPTH = MAX_SCHEMA_DEPTH + 16

StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]

# Errors from these bounds (and from bad text) are values out of range: 400, not a shape error (422).
LIMIT_ERROR_TYPES = frozenset({"too_long", "string_too_long", "unicode_surrogate", "too_deep"})

# json.loads turns a valid pair of \u escapes into one character, so any surrogate left is lone.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_body(data: object) -> object:
    """A request body's own checks before its fields are validated: its depth, then its text."""
    return reject_lone_surrogates(reject_deep(data))


def check_within_context(what: str, num_ids: int, max_model_len: int) -> None:
    """Token ids in or out of /tokenize and /detokenize: more than a sequence of this model can hold
    is no text it made or read, and the response (an id, or up to the longest token's bytes, for
    each) would grow with them."""
    if num_ids > max_model_len:
        raise InvalidRequestError(f"{what}: {num_ids} token ids, more than this model's context ({max_model_len})")


def reject_deep(data: object) -> object:
    depth = json_depth(data, MAX_BODY_DEPTH)
    if depth > MAX_BODY_DEPTH:
        raise PydanticCustomError("too_deep", "the body is nested more than {limit} levels deep",
                                  {"limit": MAX_BODY_DEPTH})
    return data


def reject_lone_surrogates(data: object) -> object:
    """Raise for any string (or key) holding a lone UTF-16 surrogate: such text cannot be encoded,
    so it would fail later in the tokenizer or in the error message that quotes it."""
    try:  # the fast path, in C: a lone surrogate is the only thing that fails to encode
        json.dumps(data, ensure_ascii=False).encode()
        return data
    except (UnicodeEncodeError, TypeError):  # TypeError: not JSON data; the walk decides
        pass
    stack: list[tuple[object, tuple]] = [(data, ())]  # (value, (parent path, key)); () is the body
    while stack:  # iterative: deeply nested JSON must not hit the recursion limit
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (path, "(a key)"))
                stack.append((item, (path, key)))
        elif isinstance(value, list):
            stack.extend((item, (path, i)) for i, item in enumerate(value))
    return data


def _check_text(text: object, path: tuple) -> None:
    match = _SURROGATE.search(text) if isinstance(text, str) else None
    if match:
        raise PydanticCustomError(
            "unicode_surrogate",
            "{field}: lone UTF-16 surrogate {char} at character {pos} is not Unicode text; "
            "send UTF-8 text (an astral character as a \\ud83d\\ude00-style pair)",
            {"field": _dotted(path), "char": ascii(match.group()), "pos": match.start()},
        )


def _dotted(path: tuple) -> str:
    keys = []
    while path:
        path, key = path
        keys.append(str(key))
    return ".".join(reversed(keys)) or "body"
