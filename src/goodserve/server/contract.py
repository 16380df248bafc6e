"""The request contract: a field goodserve does not implement is a 400 naming it, never a silent 200.

Request schemas keep the fields they do not declare (pydantic's extra="allow"); `check_fields`
refuses each by name: the OpenAI fields that exist but goodserve does not implement (listed per
schema, so the message says so), and unknown fields, which `--allow-unknown-fields` turns into a
warning for clients that send their own extensions. A field sent as null is treated as absent.
An object of a type goodserve does not run (a content part the served models cannot read, a
Responses built-in tool or input item) is refused the same way, naming its type (`refuse_other_types`),
not as a 422 about the union it failed to match.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

from goodserve.errors import InvalidRequestError

logger = logging.getLogger("goodserve.server")

UNSUPPORTED_TYPE = "unsupported_type"  # a validation error type answered with 400

class UnsupportedFieldError(InvalidRequestError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_fields(request: BaseModel, unsupported: frozenset[str], allow_unknown: bool) -> None:
    """Raise UnsupportedFieldError for the first field sent that goodserve does not implement, at the
    top or inside an object of the request (a message, a tool, a format)."""
    extra = {name: value for name, value in (request.model_extra or {}).items()
             if value is not None}
    for name in extra:
        if name in unsupported:
            raise UnsupportedFieldError(f"'{name}' is not supported by this server (see docs/serving.md)", name)
    nested = list(_nested_extras(request, ""))
    unknown = list(extra) + [path for path, _, _ in nested]
    if unknown and not allow_unknown:
        raise UnsupportedFieldError(
            f"unknown field '{unknown[0]}': this server does not implement it (start it with "
            "--allow-unknown-fields to ignore unknown fields)", unknown[0])
    if unknown:
        logger.warning("ignoring unknown field(s) %s (--allow-unknown-fields)", ", ".join(sorted(unknown)))
    for _, model, name in nested:  # ignored: never passed on (to a chat template, a response)
        model.model_extra.pop(name)


def _nested_extras(value: object, path: str):
    """(dotted path, object, name) of each field sent inside value's objects that they do not declare."""
    if isinstance(value, BaseModel):
        if path:
            for name, item in (value.model_extra or {}).items():
                if item not in (None, [], {}):  # asks for nothing, as a field sent as null
                    yield f"{path}.{name}", value, name
        for name in type(value).model_fields:
            yield from _nested_extras(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _nested_extras(item, f"{path}[{i}]")


def refuse_other_types(value: object, allowed: tuple[str, ...], what: str, why: str) -> object:
    """value (before validation) if its `type` is one of allowed (or it has none); else the error that
    names it."""
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind not in allowed:
        raise PydanticCustomError(UNSUPPORTED_TYPE, "{what} type '{kind}' is not supported: {why}",
                                  {"what": what, "kind": kind, "why": why})
    return value
