"""Pre-quantized checkpoints: one safetensors file holding the whole quantized model's state.

The header's metadata names the scheme, the group size, whether lm_head is quantized (int8;
files from before that option say nothing and have a float lm_head) and the model the codes came
from (its spec and weight revision), so loading codes into a different model, or into an engine
configured otherwise, fails with a clear error instead of producing garbage text. Tensors are
stored as they are in memory: a reload is bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import safetensors
import safetensors.torch
from torch import nn

from goodserve.errors import ModelLoadError
from goodserve.quant.apply import TARGET_LINEARS, empty_quantized_like
from goodserve.quant.linear import Int4Linear, Int8Linear

FORMAT = "goodserve-quantized/1"


def model_identity(model: nn.Module, revision: str) -> dict[str, str]:
    return {"model_spec": json.dumps(dataclasses.asdict(model.spec), sort_keys=True), "model_revision": revision}


def lm_head_quantized(model: nn.Module) -> bool:
    return isinstance(getattr(model, "lm_head", None), Int8Linear)


def quantization_of(model: nn.Module) -> tuple[str, int]:
    """(method, group_size) of the projections quantize_model swapped; group_size is 0 for int8."""
    layers = [m for name, m in model.named_modules()
              if name.rsplit(".", 1)[-1] in TARGET_LINEARS and isinstance(m, (Int8Linear, Int4Linear))]
    if not layers:
        raise ModelLoadError("this model is not quantized: run quantize_model(model, method) first")
    if all(isinstance(m, Int8Linear) for m in layers):
        return "int8", 0
    group_sizes = {getattr(m, "group_size", None) for m in layers}  # None marks an Int8Linear
    if len(group_sizes) != 1:
        raise ModelLoadError("mixed quantization schemes in one model cannot be saved as one checkpoint")
    return "int4", group_sizes.pop()


def save_quantized(model: nn.Module, path: str | Path, revision: str) -> None:
    """Write a quantized model (its spec on `model.spec`) and the identity of its source weights."""
    method, group_size = quantization_of(model)
    metadata = {"format": FORMAT, "method": method, "group_size": str(group_size),
                "lm_head": "int8" if lm_head_quantized(model) else "float", **model_identity(model, revision)}
    # save_model (not save_file) drops the duplicate name of tied tensors (lm_head = embed_tokens).
    safetensors.torch.save_model(model, str(path), metadata=metadata)


def read_metadata(path: str | Path) -> dict[str, str]:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"quantized checkpoint {path} does not exist")
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
    if metadata.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not a goodserve quantized checkpoint (no '{FORMAT}' format tag)")
    return metadata


def check_same_model(metadata: dict[str, str], model: nn.Module, revision: str, path: str | Path) -> None:
    expected = model_identity(model, revision)
    if metadata.get("model_spec") != expected["model_spec"]:
        saved_name = json.loads(metadata.get("model_spec", "{}")).get("name", "?")
        raise ModelLoadError(
            f"quantized checkpoint {path} was made from another model ({saved_name!r}, different shapes "
            f"or settings) than the one loaded ({model.spec.name!r}); quantize this model instead")
    if metadata.get("model_revision") != revision:
        raise ModelLoadError(
            f"quantized checkpoint {path} was made from other weights (revision "
            f"{metadata.get('model_revision')!r}) than the ones loaded ({revision!r}); quantize these weights instead")


def check_lm_head(metadata: dict[str, str], quantize_lm_head: bool | None, path: str | Path) -> bool:
    """Whether the checkpoint's lm_head is quantized; refuses one that differs from quantize_lm_head."""
    saved = metadata.get("lm_head", "float") == "int8"
    if quantize_lm_head is not None and saved != quantize_lm_head:
        raise ModelLoadError(
            f"quantized checkpoint {path} has {'an int8' if saved else 'a float'} lm_head, but quantize_lm_head "
            f"is {quantize_lm_head}: pass {'--quantize-lm-head' if saved else '--no-quantize-lm-head'} to serve "
            "it, or quantize again with the lm_head you want")
    return saved


def load_quantized_into(model: nn.Module, path: str | Path, revision: str,
                        quantize_lm_head: bool | None = None) -> nn.Module:
    """Swap `model`'s linears for quantized ones and fill the whole model from the checkpoint.

    `model` is the unquantized model the checkpoint was made from (its weights may be
    uninitialized, e.g. build_empty_model); `revision` is the identity of its weights.
    quantize_lm_head: what the caller expects of lm_head (a mismatch is an error); None takes the
    checkpoint's.
    """
    metadata = read_metadata(path)
    check_same_model(metadata, model, revision, path)
    lm_head = check_lm_head(metadata, quantize_lm_head, path)
    empty_quantized_like(model, metadata["method"], int(metadata["group_size"]) or 128, lm_head)
    device = next(model.parameters()).device
    missing, unexpected = safetensors.torch.load_model(model, str(path), strict=False, device=str(device))
    if missing or unexpected:
        raise ModelLoadError(f"quantized checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    return model
