"""The tokenizer a benchmark counts and builds prompts with, loaded without the model's weights."""

from __future__ import annotations

from pathlib import Path

from goodserve.model.tokenizer import Tokenizer


def load_bench_tokenizer(name: str | None) -> Tokenizer | None:
    """Tokenizer for any model name the engine accepts: the embedded model, `dummy:<preset>`
    (the embedded tokenizer when the vocabulary holds it), a .gguf file, a HF directory.

    None when there is none here (a hosted model's name, a small dummy vocabulary): the bench
    then approximates prompt lengths with words and takes output counts from the server's usage.
    """
    from goodserve.model import loader
    from goodserve.model.gguf_loader import gguf_tokenizer, open_gguf
    from goodserve.model.hf_loader import hf_tokenizer, is_hf_model_dir
    from goodserve.model.presets import PRESETS

    if not name:
        return None
    if name == loader.EMBEDDED_MODEL:
        return loader.embedded_tokenizer()
    if name.startswith(loader.DUMMY_PREFIX):
        preset = PRESETS.get(name.removeprefix(loader.DUMMY_PREFIX))
        fits = preset is not None and preset.vocab_size >= PRESETS[loader.EMBEDDED_MODEL].vocab_size
        return loader.embedded_tokenizer() if fits else None
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(open_gguf(path))
    if is_hf_model_dir(path):
        from goodserve.diagnose.model_shape import resolve_spec

        return hf_tokenizer(path, resolve_spec(name))
    return None
