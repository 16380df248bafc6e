"""Text <-> token ids, and chat templates rendered the way Hugging Face renders them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from goodserve.errors import InvalidRequestError


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        # HF decides BOS in tokenizer_config; a backend post-processor may add it too, never both.
        self.add_bos_token = add_bos_token and bos_token_id is not None

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        return Tokenizer(self.backend, bos_token_id=self.bos_token_id, eos_token_ids=self.eos_token_ids,
                         chat_template=chat_template, add_bos_token=self.add_bos_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(
            token_id for token_id, added in self.backend.get_added_tokens_decoder().items() if added.special
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a server tokenizing a long
        # prompt in a thread keeps its event loop running.
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **kwargs: Any
    ) -> str:
        """The prompt, as transformers renders it; continue_final_message ends it inside the last
        message (no end of turn after it), so the model continues that message's text."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message, add_generation_prompt "
                                      "starts a new one: set add_generation_prompt to false")
        try:
            rendered = _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}") from e
        return _cut_after_final_message(rendered, messages[-1]) if continue_final_message else rendered

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """chat_template_kwargs name variables of this model's template that the server does not set
        itself. A name the template never reads renders as undefined, which Jinja takes as false: given
        a false value (a client's `enable_thinking: false` sent to every model) the prompt is what the
        client asked for, so it passes, as in vLLM; given any other value it would be silently ignored,
        so it is refused."""
        kwargs = {name: value for name, value in kwargs.items() if value or name in _SERVER_SET_VARIABLES}
        if not kwargs:
            return
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        free = _template_variables(self.chat_template) - _SERVER_SET_VARIABLES
        for name in kwargs:
            if name in _SERVER_SET_VARIABLES:
                raise InvalidRequestError(f"chat_template_kwargs may not set '{name}': the server sets it")
            if name not in free:
                raise InvalidRequestError(f"chat_template_kwargs '{name}' is not a variable of this model's chat "
                                          f"template, so {kwargs[name]!r} would change nothing (those it reads: "
                                          f"{', '.join(sorted(free)) or 'none'})")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if not isinstance(content, (str, type(None))):
            raise InvalidRequestError(f"messages[{i}].content must be a string")


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself (vLLM's rule: Jinja syntax in the value
    means a template), checked to compile."""
    path = Path(value).expanduser()
    if path.is_file():
        source = path.read_text()
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise InvalidRequestError(f"--chat-template: no file {value} (nor a Jinja template: no '{{{{' or '{{%' in it)")
    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from e
    return source


def _cut_after_final_message(rendered: str, final: dict[str, Any]) -> str:
    """The rendered prompt up to the end of the last message's text (transformers' rule: the text as
    sent, else stripped, for templates that trim it)."""
    text = final.get("content") or ""
    if not text.strip():
        raise InvalidRequestError("continue_final_message needs a last message with text to continue")
    for candidate in (text, text.strip()):
        end = rendered.rfind(candidate)
        if end >= 0:
            return rendered[: end + len(candidate)]
    raise InvalidRequestError("continue_final_message: the chat template changed the last message's text, so "
                              "the prompt cannot end inside it")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# What apply_chat_template passes itself, and the environment's globals: not chat_template_kwargs'.
_SERVER_SET_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                   "raise_exception", "strftime_now"})


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # The same environment settings as transformers' apply_chat_template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str]:
    """The variables a template reads without setting them itself."""
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
