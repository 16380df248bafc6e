"""The request contract: a field goodserve does not implement is a 400 naming it, never a silent 200.

Request schemas keep the fields they do not declare (pydantic's extra="allow"); `check_fields`
refuses each by name: the OpenAI fields that exist but goodserve does not implement (listed per
schema, so the message says so), and unknown fields, which `--allow-unknown-fields` turns into a
warning for clients that send their own extensions. A field sent as null is treated as absent.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from goodserve.errors import InvalidRequestError

logger = logging.getLogger("goodserve.server")

# Declared by the structured-outputs / tool-calling work of issue 18, which lands separately: until it
# does they are accepted and ignored as before (unless a schema lists them as unsupported, as
# Responses does its tools). Once the chat and completions schemas declare them, this set goes.
PENDING_FIELDS = frozenset({
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern",
})


class UnsupportedFieldError(InvalidRequestError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_fields(request: BaseModel, unsupported: frozenset[str], allow_unknown: bool,
                 pending: frozenset[str] = PENDING_FIELDS) -> None:
    """Raise UnsupportedFieldError for the first field sent that goodserve does not implement."""
    extra = {name: value for name, value in (request.model_extra or {}).items()
             if value is not None and (name not in pending or name in unsupported)}
    for name in extra:
        if name in unsupported:
            raise UnsupportedFieldError(f"'{name}' is not supported by this server (see docs/serving.md)", name)
    if extra and not allow_unknown:
        name = next(iter(extra))
        raise UnsupportedFieldError(
            f"unknown field '{name}': this server does not implement it (start it with "
            "--allow-unknown-fields to ignore unknown fields)", name)
    if extra:
        logger.warning("ignoring unknown field(s) %s (--allow-unknown-fields)", ", ".join(sorted(extra)))
