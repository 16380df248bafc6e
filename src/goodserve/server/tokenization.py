"""Prompt tokenization off the event loop, and a refusal before tokenizing text that cannot fit.

Tokenizing a 4 MB prompt takes seconds; on the event loop it stalls every other request and
/health with it. A small thread pool does it instead (the tokenizer releases the GIL while it
encodes). A prompt of more UTF-8 bytes than max_model_len tokens can ever cover is refused at
once: no token covers more bytes than the longest token in the vocabulary, so such a prompt has
more than max_model_len tokens whatever they are.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from goodserve.errors import PromptTooLongError

TOKENIZER_THREADS = 2

# Tokenizer stages that never drop or fold input text, so each token's text is at least as long
# (in UTF-8) as the input it came from. NFC / NFKC fold (3 Hangul jamo into 1 syllable), whitespace
# splitters drop spaces, Strip drops: with those, text length says nothing about token count.
_KEEPING_NORMALIZERS = frozenset({"Prepend", "Replace", "Sequence"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "Sequence"})


def _keeps_all_text(stage: dict | None, allowed: frozenset[str]) -> bool:
    if stage is None:
        return True
    kind = stage["type"]
    if kind not in allowed or stage.get("behavior") == "Removed":  # Split can drop its matches
        return False
    if kind == "Replace" and not _replace_grows(stage):
        return False
    children = stage.get("normalizers") or stage.get("pretokenizers") or []
    return all(_keeps_all_text(child, allowed) for child in children)


def _replace_grows(stage: dict) -> bool:
    """A fixed string replaced by one at least as long (' ' -> '▁'); a regex may match anything."""
    pattern = stage["pattern"].get("String")
    return pattern is not None and len(stage["content"].encode()) >= len(pattern.encode())


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def max_prompt_bytes(tokenizer, max_model_len: int) -> int | None:
    """UTF-8 bytes past which a prompt surely has more than max_model_len tokens; None where the
    tokenizer may drop or fold text (then only tokenizing can tell)."""
    backend = tokenizer.backend
    model = backend.model
    unknowns_fuse = getattr(model, "fuse_unk", False) and not getattr(model, "byte_fallback", False)
    if (type(model).__name__ != "BPE" or unknowns_fuse
            or not _keeps_all_text(_state(backend.normalizer), _KEEPING_NORMALIZERS)
            or not _keeps_all_text(_state(backend.pre_tokenizer), _KEEPING_PRE_TOKENIZERS)):
        return None
    # A token's vocabulary text is at least its input's bytes (byte-level: one char per byte,
    # Metaspace: '▁' for ' ', byte fallback: '<0x41>'); 4 covers one unknown character.
    longest = max(len(token.encode()) for token in backend.get_vocab(with_added_tokens=True))
    return max_model_len * max(longest, 4)


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int, threads: int = TOKENIZER_THREADS):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_bytes = max_prompt_bytes(tokenizer, max_model_len)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="goodserve-tokenize")

    def check_fits(self, num_bytes: int) -> None:
        """Refuse, before tokenizing, text that surely has more tokens than max_model_len."""
        if self.max_bytes is not None and num_bytes > self.max_bytes:
            raise PromptTooLongError(
                f"the prompt has {num_bytes} UTF-8 bytes, more than {self.max_model_len} tokens can cover "
                f"(at most {self.max_bytes} bytes for this model's tokenizer and context): shorten the prompt"
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.check_fits(len(text.encode()))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _encode_chat(self, conversation: list[dict], render_kwargs: dict) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, **render_kwargs)
        # The template writes the special tokens itself (as transformers' apply_chat_template).
        return self._encode(text, add_special_tokens=False)

    async def in_pool(self, fn, *args):
        """fn(*args) on the pool: host work that must not stall the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_fits(len(text.encode()))  # here too, so a refusal does not wait for the pool
        return await self.in_pool(self._encode, text, add_special_tokens)

    async def encode_chat(self, conversation: list[dict], render_kwargs: dict) -> list[int]:
        """render_kwargs: apply_chat_template's (add_generation_prompt, continue_final_message, the
        template's own variables)."""
        # The rendered prompt holds every message's text, so their sum is a lower bound of its size.
        self.check_fits(sum(len((m["content"] or "").encode()) for m in conversation))
        return await self.in_pool(self._encode_chat, conversation, render_kwargs)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
