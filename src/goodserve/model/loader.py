"""One entry point for every way a model can be named (model_names.py): the embedded model, a GGUF
file, a Hugging Face directory, or `dummy:<preset>` random weights."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from goodserve.errors import InvalidRequestError, ModelLoadError
from goodserve.model.dummy_loader import load_dummy
from goodserve.model.gguf_loader import gguf_spec, load_gguf
from goodserve.model.gguf_reader import open_gguf
from goodserve.model.hf_loader import is_hf_model_dir, load_hf, read_hf_spec, safetensors_files
from goodserve.model.llama import LlamaForCausalLM
from goodserve.model.presets import get_preset
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.spec import ModelSpec
from goodserve.model.tensor_parallel import TensorParallel
from goodserve.model.tokenizer import Tokenizer
from goodserve.model.tokenizer_loader import dummy_tokenizer
from goodserve.model_names import ACCEPTED_FORMS, DUMMY_PREFIX, EMBEDDED_MODEL, gguf_model_path, model_path


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    source: str  # what was loaded, for logs and /v1/models
    revision: str  # identity of the weights: salts prefix-cache keys so two models never share blocks


def load_model(name: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
               keep_gguf_quantization: bool = False, tp: TensorParallel = TensorParallel(),
               pp: PipelineParallel = PipelineParallel(), quantization: str | None = None,
               group_size: int | None = None) -> LoadedModel:
    """keep_gguf_quantization: a GGUF model's Q4_0 / Q4_1 / Q8_0 linears keep the file's codes
    (model/gguf_loader.py); any other model is refused. tp, pp: which rank's share to load (all of it
    at TP=1, PP=1). quantization (group_size: int4's): the weight quantization to come, which a
    mixture of experts' experts take while they load (model/moe.py)."""
    device = torch.device(device)
    path = model_path(name)
    is_gguf = gguf_model_path(name) is not None
    if keep_gguf_quantization and not is_gguf:
        raise InvalidRequestError(
            f"quantization 'gguf' keeps a GGUF file's own quantized weights, but {name!r} is not a GGUF "
            f"model: use '{EMBEDDED_MODEL}' or a .gguf file, or --quantization int8 / int4")
    if path is None:
        return _load_dummy(name.removeprefix(DUMMY_PREFIX), dtype, device, seed, tp, pp, quantization, group_size)
    if is_gguf:
        spec, model, tokenizer = load_gguf(path, dtype, device, keep_gguf_quantization, tp, pp, quantization,
                                           group_size)
        if name == EMBEDDED_MODEL:
            spec = replace(spec, name=EMBEDDED_MODEL)
        return LoadedModel(spec, model, tokenizer, source=str(path), revision=_files_digest([path]))
    if is_hf_model_dir(path):
        spec, model, tokenizer = load_hf(path, dtype, device, tp, pp, quantization, group_size)
        files = [path / "config.json", *safetensors_files(path)]
        return LoadedModel(spec, model, tokenizer, source=str(path), revision=_files_digest(files))
    raise ModelLoadError(f"cannot load model {name!r}: expected {ACCEPTED_FORMS}")


def load_spec(name: str) -> ModelSpec:
    """A model's shapes without its weights (a preset, a GGUF file's metadata, a config.json): what
    sizing memory for it takes."""
    path = model_path(name)
    if path is None:
        return get_preset(name.removeprefix(DUMMY_PREFIX))
    if gguf_model_path(name) is not None:
        return gguf_spec(open_gguf(path), name=EMBEDDED_MODEL if name == EMBEDDED_MODEL else path.stem)
    if is_hf_model_dir(path):
        return read_hf_spec(path)
    raise ModelLoadError(f"cannot load model {name!r}: expected {ACCEPTED_FORMS}")


def _load_dummy(preset: str, dtype: torch.dtype, device: torch.device, seed: int,
                tp: TensorParallel, pp: PipelineParallel, quantization: str | None,
                group_size: int | None) -> LoadedModel:
    spec = get_preset(preset)
    model = load_dummy(spec, dtype, device, seed, tp, pp, quantization, group_size)
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
