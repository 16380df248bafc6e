"""A model's shape (ModelSpec) from any name the engine accepts, without loading its weights."""

from __future__ import annotations

import json

from goodserve.errors import ModelLoadError
from goodserve.model.presets import PRESETS, get_preset
from goodserve.model.spec import ModelSpec
from goodserve.model_names import DUMMY_PREFIX, model_path


def resolve_spec(name: str) -> ModelSpec:
    """A preset name, `dummy:<preset>`, the embedded model, a .gguf file, or a HF directory."""
    preset = name.removeprefix(DUMMY_PREFIX)
    if preset in PRESETS:
        return get_preset(preset)
    path = model_path(name)  # None: an unknown dummy preset
    if path is not None and path.is_file() and path.suffix == ".gguf":
        from goodserve.model.gguf_loader import gguf_spec
        from goodserve.model.gguf_reader import open_gguf

        return gguf_spec(open_gguf(path), path.stem)
    if path is not None and (path / "config.json").is_file():
        from goodserve.model.hf_loader import hf_spec

        def read(file: str) -> dict:
            try:
                return json.loads((path / file).read_text()) if (path / file).is_file() else {}
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"cannot read {path / file}: {exc}") from exc

        try:
            return hf_spec(read("config.json"), path.name, read("generation_config.json"), shape_only=True)
        except KeyError as exc:
            raise ModelLoadError(f"{path / 'config.json'} lacks the field {exc}") from None
    raise ModelLoadError(f"unknown model {name!r}: give a preset ({', '.join(PRESETS)}), "
                         f"dummy:<preset>, a .gguf file or a Hugging Face model directory")
