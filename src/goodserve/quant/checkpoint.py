"""Pre-quantized checkpoints: one safetensors file holding the whole quantized model's state.

The header's metadata names the scheme, the group size, how lm_head is quantized ("int8", "int4"
with the layers' group size, or "float"; files from before that option say nothing and have a float
lm_head) and the model the codes came
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
from goodserve.quant.fp8_linear import Fp8Linear
from goodserve.quant.linear import Int4Linear, Int8Linear

FORMAT = "goodserve-quantized/1"


def model_identity(model: nn.Module, revision: str) -> dict[str, str]:
    return {"model_spec": json.dumps(dataclasses.asdict(model.spec), sort_keys=True), "model_revision": revision}


def lm_head_format(model: nn.Module) -> str:
    """"int8", "int4" or "float": the checkpoint metadata's name for the model's lm_head."""
    head = getattr(model, "lm_head", None)
    return "int8" if isinstance(head, Int8Linear) else "int4" if isinstance(head, Int4Linear) else "float"


def quantization_of(model: nn.Module) -> tuple[str, int]:
    """(method, group_size) of the projections quantize_model swapped; group_size is 0 for int8 and fp8."""
    layers = [m for name, m in model.named_modules()
              if name.rsplit(".", 1)[-1] in TARGET_LINEARS and isinstance(m, (Int8Linear, Int4Linear, Fp8Linear))]
    if not layers:
        raise ModelLoadError("this model is not quantized: run quantize_model(model, method) first")
    for method, cls in (("int8", Int8Linear), ("fp8", Fp8Linear)):
        if all(isinstance(m, cls) for m in layers):
            return method, 0
    group_sizes = {getattr(m, "group_size", None) for m in layers}  # None marks an Int8Linear / Fp8Linear
    if len(group_sizes) != 1:
        raise ModelLoadError("mixed quantization schemes in one model cannot be saved as one checkpoint")
    return "int4", group_sizes.pop()


def save_quantized(model: nn.Module, path: str | Path, revision: str) -> None:
    """Write a quantized model (its spec on `model.spec`) and the identity of its source weights."""
    method, group_size = quantization_of(model)
    metadata = {"format": FORMAT, "method": method, "group_size": str(group_size),
                "lm_head": lm_head_format(model), **model_identity(model, revision)}
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


def check_lm_head(metadata: dict[str, str], quantize_lm_head: bool | None, lm_head_quantization: str | None,
                  path: str | Path) -> str | None:
    """The checkpoint's lm_head method ("int8" / "int4"), None for a float one; refuses one that differs
    from quantize_lm_head, or (when quantized) from lm_head_quantization. None asks nothing."""
    saved = metadata.get("lm_head", "float")
    if quantize_lm_head is not None and (saved != "float") != quantize_lm_head:
        raise ModelLoadError(
            f"quantized checkpoint {path} has {'an ' + saved if saved != 'float' else 'a float'} lm_head, but "
            f"quantize_lm_head is {quantize_lm_head}: pass "
            f"{'--quantize-lm-head' if saved != 'float' else '--no-quantize-lm-head'} to serve "
            "it, or quantize again with the lm_head you want")
    if quantize_lm_head and lm_head_quantization is not None and saved != lm_head_quantization:
        raise ModelLoadError(
            f"quantized checkpoint {path} has an {saved} lm_head, but lm_head_quantization is "
            f"{lm_head_quantization!r}: pass --lm-head-quantization {saved} to serve it, or quantize again")
    return None if saved == "float" else saved


def load_quantized_into(model: nn.Module, path: str | Path, revision: str, quantize_lm_head: bool | None = None,
                        lm_head_quantization: str | None = None) -> nn.Module:
    """Swap `model`'s linears for quantized ones and fill the whole model from the checkpoint.

    `model` is the unquantized model the checkpoint was made from (its weights may be
    uninitialized, e.g. build_empty_model); `revision` is the identity of its weights.
    quantize_lm_head, lm_head_quantization: what the caller expects of lm_head (a mismatch is an
    error); None takes the checkpoint's.
    """
    metadata = read_metadata(path)
    check_same_model(metadata, model, revision, path)
    lm_head = check_lm_head(metadata, quantize_lm_head, lm_head_quantization, path)
    empty_quantized_like(model, metadata["method"], int(metadata["group_size"]) or 128, lm_head)
    device = next(model.parameters()).device
    missing, unexpected = safetensors.torch.load_model(model, str(path), strict=False, device=str(device))
    if missing or unexpected:
        raise ModelLoadError(f"quantized checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    return model
