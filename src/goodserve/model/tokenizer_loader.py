"""A model name's tokenizer on its own (vLLM's --tokenizer), without the model's weights or torch:
the engine reads it beside the weights (loader.py), the bench to build and count prompts."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from goodserve.errors import ModelLoadError
from goodserve.model.gguf_reader import open_gguf
from goodserve.model.gguf_tokenizer import gguf_tokenizer
from goodserve.model.hf_tokenizer import hf_tokenizer
from goodserve.model.presets import get_preset
from goodserve.model.spec import ModelSpec
from goodserve.model.tokenizer import Tokenizer
from goodserve.model_names import EMBEDDED_MODEL, embedded_gguf_path, embedded_model_installed, gguf_model_path


@lru_cache(maxsize=1)  # cache: the embedded tokenizer is shared by every large dummy model
def embedded_tokenizer() -> Tokenizer:
    return gguf_tokenizer(open_gguf(embedded_gguf_path()))


def load_tokenizer(name: str, spec: ModelSpec | None = None) -> Tokenizer:
    """The embedded model's tokenizer, a GGUF file's, or an HF directory's."""
    if name == EMBEDDED_MODEL:
        return embedded_tokenizer()
    path = gguf_model_path(name)
    if path is not None:
        return gguf_tokenizer(open_gguf(path))
    path = Path(name).expanduser()
    tokenizer = hf_tokenizer(path, spec) if path.is_dir() else None
    if tokenizer is None:
        raise ModelLoadError(
            f"no tokenizer at {name!r}: expected '{EMBEDDED_MODEL}', a .gguf file, "
            "or a directory with tokenizer.json"
        )
    return tokenizer


def dummy_tokenizer(spec: ModelSpec) -> Tokenizer | None:
    """Random-weight models borrow the embedded tokenizer when its ids all fit their vocabulary."""
    fits = spec.vocab_size >= get_preset(EMBEDDED_MODEL).vocab_size
    return embedded_tokenizer() if fits and embedded_model_installed() else None
