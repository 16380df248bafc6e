"""Tools on the request side: what the prompt says about them, and the grammar a forced call follows.

- The chat template renders the tools when it knows them (its source mentions `tools`); otherwise
  (SmolLM2's template does not) a Hermes-style system block lists them, as Hermes / Qwen templates
  write it, assistant `tool_calls` become `<tool_call>` blocks in the assistant's text and `tool`
  messages a `<tool_response>` block: the model sees the format the `auto` parser reads back.
- tool_choice `required`: the output is a JSON array of calls, each one of the tools with arguments
  of its parameters schema (one call when parallel_tool_calls is false). After each complete call the
  grammar allows `,` or `]`, and after `]` only the end of generation. A call identical to an earlier
  one (same name and arguments) is never useful, yet a small model, once it repeats, repeats until
  max_tokens: the array ends where it completes one (the repeat dropped, the request stopped there,
  finish_reason "tool_calls"). A named function: the
  output is that function's arguments. `auto` (the default with tools) leaves the text free and
  server/tool_parsers.py finds the calls in it; `none` neither renders tools nor parses.
"""

from __future__ import annotations

import json

from goodserve.errors import InvalidRequestError
from goodserve.server.tool_parsers import ToolCallText, loads_or_none, parse_tool_calls
from goodserve.server.structured import grammar_of
from goodserve.structured_outputs import StructuredOutputsParams

_HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call>"
    "</tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-dict>}}\n</tool_call>")


def tool_mode(req) -> str:
    """'none' (no tools, or tool_choice none), 'auto', 'required' or 'named'."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools")
        return "none"
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.function.name not in {t.function.name for t in req.tools}:
        raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
    return "named"


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_grammar(req) -> StructuredOutputsParams | None:
    mode = tool_mode(req)
    if mode == "named":
        tool = next(t for t in req.tools if t.function.name == req.tool_choice.function.name)
        return grammar_of(f"tools[{req.tools.index(tool)}].function.parameters", json=_parameters(tool))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
              "required": ["name", "arguments"]} for t in req.tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return grammar_of("tools", json=schema)


def forced_calls(req, text: str, truncated: bool = False) -> list[ToolCallText] | None:
    """The calls a required / named output holds; None if it is not complete JSON. truncated (cut by
    max_tokens, finish_reason "length"): what it holds so far, as OpenAI reports a cut call: the
    calls of a required array that were complete, a named call with its arguments as far as they came."""
    mode = tool_mode(req)
    if mode == "named":
        complete = loads_or_none(text) is not None
        return [ToolCallText(req.tool_choice.function.name, text)] if complete or truncated else None
    calls = loads_or_none(text)
    if not isinstance(calls, list):
        calls = _complete_items(text)
        if not truncated and not _repeats(calls):  # neither cut nor ended at a repeat: not an array of calls
            return None
    return [ToolCallText(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in _before_repeat(calls)]


def _before_repeat(calls: list) -> list:
    """The calls before the first one identical (name and arguments) to an earlier one."""
    for i, call in enumerate(calls):
        if call in calls[:i]:
            return calls[:i]
    return calls


def _repeats(calls: list) -> bool:
    return len(_before_repeat(calls)) < len(calls)


def repeated_call_check(req):
    """For GenerationJob.ends_early: under tool_choice required, whether a choice's text (which just
    gained `added`) has completed a call identical to an earlier one; None in the other modes."""
    if tool_mode(req) != "required":
        return None
    return lambda text, added: "}" in added and _repeats(_complete_items(text))  # a call completes with a }


def _complete_items(text: str) -> list:
    """The elements of a JSON array cut short that were complete before the cut."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    while at > 0:
        at = len(text) - len(text[at:].lstrip())
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
        at = len(text) - len(text[at:].lstrip())
        at = at + 1 if text[at:at + 1] == "," else 0
    return items


def output_calls(req, mode: str, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCallText]]:
    """A finished output's (content, calls) under tool_mode(req) `mode`; truncated: it hit max_tokens.
    A forced output cut short is no content: its complete calls are returned, the finish reason
    ("length") says the rest was cut."""
    if mode == "auto":
        return parse_tool_calls(text)
    if mode in ("required", "named"):
        calls = forced_calls(req, text, truncated)
        return (None, calls) if calls or truncated else (text, [])
    return text, []


def prompt_tools(req) -> list[dict]:
    """The tools the prompt shows the model (none with tool_choice none)."""
    return [t.model_dump(exclude_none=True) for t in req.tools or []] if tool_mode(req) != "none" else []


def conversation(messages: list, tools: list[dict], template: str | None) -> tuple[list[dict], dict]:
    """The messages as the chat template takes them, and the template's extra arguments (tools)."""
    if template is not None and "tools" in template:  # the template renders tools and tool messages
        return [_template_message(m) for m in messages], ({"tools": tools} if tools else {})
    messages = [{"role": m.role, "content": _hermes_content(m)} for m in messages]
    if tools:
        block = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages, {}


def _template_message(message) -> dict:
    """As transformers hands templates a call: arguments as an object (templates `tojson` them)."""
    rendered = message.model_dump(exclude_none=True) | {"content": message.text()}
    for call in rendered.get("tool_calls", []):
        arguments = loads_or_none(call["function"]["arguments"])
        if isinstance(arguments, dict):
            call["function"]["arguments"] = arguments
    return rendered


def _hermes_content(message) -> str:
    if message.role == "tool":
        return f"<tool_response>\n{message.text()}\n</tool_response>"
    calls = [f'<tool_call>\n{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}\n'
             "</tool_call>" for c in message.tool_calls or []]
    return "\n".join([message.text()] * bool(message.text()) + calls)
