"""The text a request's prompt starts with, for prefix routing: no tokenizer, the router serves any model."""

from __future__ import annotations

import json


class UnreadableBody(ValueError):
    """A body the router cannot parse: answered 400 without troubling a replica."""


def _as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def prompt_text(body: bytes) -> str:
    """messages (chat), prompt (completions) or input (embeddings, responses) as one string; requests
    that share a system prompt or a document share its prefix. A JSON value other than an object: ""
    (the replica answers its 400). Not JSON, or nested past the interpreter's recursion limit:
    UnreadableBody."""
    try:
        request = json.loads(body)
        return _prompt_of(request) if isinstance(request, dict) else ""
    except RecursionError:
        raise UnreadableBody("the request body nests JSON too deeply") from None
    except ValueError as exc:
        raise UnreadableBody(f"the request body is not valid JSON: {exc}") from None


def _prompt_of(request: dict) -> str:
    messages = request.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role')}: {_as_text(m.get('content'))}\n" if isinstance(m, dict) else _as_text(m)
                       for m in messages)
    for field in ("prompt", "input"):
        if field in request:
            return _as_text(request.get("instructions") or "") + _as_text(request[field])
    return ""
