"""The tokenizer a benchmark counts and builds prompts with, loaded without the model's weights or torch."""

from __future__ import annotations

from goodserve.errors import ModelLoadError
from goodserve.model.presets import PRESETS
from goodserve.model.tokenizer import Tokenizer
from goodserve.model.tokenizer_loader import dummy_tokenizer, load_tokenizer
from goodserve.model_names import DUMMY_PREFIX


def load_bench_tokenizer(name: str | None) -> Tokenizer | None:
    """Tokenizer for any model name the engine accepts: the embedded model, `dummy:<preset>`
    (the embedded tokenizer when the vocabulary holds it), a .gguf file, a HF directory.

    None when there is none here (a hosted model's name, a small dummy vocabulary): the bench
    then approximates prompt lengths with words and takes output counts from the server's usage.
    """
    if not name:
        return None
    if name.startswith(DUMMY_PREFIX):
        preset = PRESETS.get(name.removeprefix(DUMMY_PREFIX))
        return dummy_tokenizer(preset) if preset is not None else None
    try:
        return load_tokenizer(name)
    except ModelLoadError:
        return None
