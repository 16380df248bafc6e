"""Tool calls in model text (tool_choice auto): Hermes-style `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` blocks, or a whole answer that is one Llama-3.x JSON call (`{"name": ...,
"parameters": ...}`, optionally after `<|python_tag|>`).

`parse_tool_calls` reads a finished text. `ToolCallStream` turns a growing text into deltas as
OpenAI streams them: content until a call starts, then per call a header (index, id, name) and
argument chunks whose concatenation is the call's arguments. It re-reads the whole text each time
(outputs are short) and sends only what no later text can change: a tail that may be the start of
`<tool_call>` waits, and so do an unfinished call's trailing braces (they may close the call, not
its arguments). A text that starts with `{` may be a Llama-3 call: it is held to the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolCallText:
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_from_json(value) -> ToolCallText | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCallText(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def loads_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes_blocks(text: str) -> list[str]:
    """The bodies of the <tool_call> blocks (the last may be unclosed: the model stopped there)."""
    return [part.split(CLOSE, 1)[0].strip() for part in text.split(OPEN)[1:]]


def _llama_json(text: str) -> list[ToolCallText] | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    calls = [_call_from_json(loads_or_none(part)) for part in body.split(";")] if ";" in body and \
        loads_or_none(body) is None else [_call_from_json(loads_or_none(body))]
    return calls if calls and all(calls) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCallText]]:
    """(content, calls) of a finished text; (text, []) when it holds no well-formed call."""
    if OPEN in text:
        calls = [_call_from_json(loads_or_none(body)) for body in _hermes_blocks(text)]
        if calls and all(calls):
            return text.split(OPEN, 1)[0].strip() or None, calls
        return text, []
    calls = _llama_json(text)
    return (None, calls) if calls else (text, [])


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


@dataclass
class _SentCall:
    id: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    text: str = ""
    content_sent: int = 0
    calls: list[_SentCall] = field(default_factory=list)

    @property
    def found_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """Add text; (content delta, tool-call deltas) that are now certain. final: the text is complete."""
        self.text += delta
        if self.text.lstrip().startswith(("{", PYTHON_TAG)) and OPEN not in self.text:
            return self._llama_at_end(final)
        start = self.text.find(OPEN)
        content_end = start if start >= 0 else len(self.text) - (0 if final else _partial_tag_len(self.text, OPEN))
        content = self.text[self.content_sent:content_end]
        if start >= 0 and not self.calls:
            content = content.rstrip()  # the blank line before the first call is not content
        self.content_sent = max(self.content_sent, content_end)
        deltas = [] if start < 0 else self._call_deltas(self.text[start:].split(OPEN)[1:], final)
        return content, deltas

    def _llama_at_end(self, final: bool) -> tuple[str, list[dict]]:
        if not final:
            return "", []
        calls = _llama_json(self.text)
        if not calls:
            content, self.content_sent = self.text[self.content_sent:], len(self.text)
            return content, []
        return "", [self._whole_call(i, call) for i, call in enumerate(calls)]

    def _whole_call(self, index: int, call: ToolCallText) -> dict:
        self.calls.append(_SentCall(new_call_id(), call.arguments))
        return _delta(index, self.calls[-1].id, call.name, call.arguments)

    def _call_deltas(self, parts: list[str], final: bool) -> list[dict]:
        deltas = []
        for index, part in enumerate(parts):
            closed = CLOSE in part
            body = part.split(CLOSE, 1)[0]
            name, args = _name_and_arguments(body, complete=closed or final)
            if index == len(self.calls):
                if name is None:
                    break
                self.calls.append(_SentCall(new_call_id()))
                deltas.append(_delta(index, self.calls[index].id, name, ""))
            sent = self.calls[index]
            if args is not None and args.startswith(sent.arguments) and len(args) > len(sent.arguments):
                deltas.append(_delta(index, None, None, args[len(sent.arguments):]))
                sent.arguments = args
        return deltas


def _name_and_arguments(body: str, complete: bool) -> tuple[str | None, str | None]:
    """A call's name once its string is closed, and the part of its arguments' text that is certain."""
    name_match, args_match = _NAME.search(body), _ARGUMENTS.search(body)
    name = loads_or_none(f'"{name_match.group(1)}"') if name_match else None
    if args_match is None or name_match is None or name_match.start() > args_match.start():
        return name, None  # arguments before the name: sent whole once the call is complete
    start = args_match.end()
    if complete:
        try:
            _, end = json.JSONDecoder().raw_decode(body, start)
        except ValueError:
            return name, None
        return name, body[start:end]
    tail = body[start:]
    tail = tail[: len(tail) - _partial_tag_len(tail, CLOSE)]
    return name, tail.rstrip().rstrip("}").rstrip()


def _delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict:
    delta: dict = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        delta.update(id=call_id, type="function")
        delta["function"]["name"] = name
    return delta
