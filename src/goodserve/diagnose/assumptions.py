"""What diagnose assumes about a run: the model, weight / compute / KV dtypes, the hardware, and
whether pipeline stages worked on micro-batches at once.

The engine configuration the run recorded (bench result JSON, or a live server's
`goodserve:engine_config_info`) wins: it is what ran. A flag that disagrees with it gets a
warning, since computing MBU with the wrong bytes per weight is off by 2x (bf16 assumed on a
float32 CPU engine). Without a recorded configuration (or a label an older goodserve did not
record) the flags apply, then defaults: for micro-batches the engine's own on that hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from goodserve.diagnose.parallel import engine_default_micro_batches
from goodserve.hardware import HARDWARE, hardware_for_device

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_HARDWARE = "h100-sxm"
_TORCH_TO_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8",
                   "float8_e4m3fn": "fp8"}
# gguf keeps the file's Q4_0 / Q4_1 / Q8_0 codes: about 4 bits a weight for the usual Q4 files.
_QUANT_WEIGHT_DTYPE = {"int8": "int8", "int4": "int4", "gguf": "int4", "fp8": "fp8"}

@dataclass
class Assumptions:
    model: str
    hardware: str  # a HARDWARE key (a wrong --hardware name is refused when it is looked up)
    weight_dtype: str  # bytes per weight: fp32 / bf16 / fp16 / int8 / int4
    compute_dtype: str  # what the matmuls multiply in (weight-only quantization: the activations')
    kv_dtype: str
    micro_batches: bool  # the pipeline stages worked on micro-batches at once
    engine: dict[str, str] | None = None  # the recorded engine configuration, if any
    source: str = "flags"
    warnings: list[str] = field(default_factory=list)


def _from_engine(engine: dict[str, str]) -> dict[str, str | bool | None]:
    compute = _TORCH_TO_SHORT.get(engine.get("dtype", ""), "bf16")
    micro_batches = engine.get("pipeline_micro_batches")
    return {
        "model": engine.get("model"),
        "hardware": hardware_for_device(engine.get("device", ""), engine.get("device_name", "")),
        "weight_dtype": _QUANT_WEIGHT_DTYPE.get(engine.get("quantization", "none"), compute),
        # fp8 multiplies fp8 weights by fp8 activations (quant/fp8_linear.py); its KV stays in the model dtype
        "compute_dtype": "fp8" if engine.get("quantization") == "fp8" else compute,
        "kv_dtype": _TORCH_TO_SHORT.get(engine.get("kv_cache_dtype", ""), compute),
        "micro_batches": None if micro_batches is None else micro_batches == "True",
    }


def _readable_here(model: str) -> bool:
    """A run recorded on another machine may name a model directory this one lacks."""
    from goodserve.diagnose.model_shape import resolve_spec
    from goodserve.errors import ModelLoadError

    try:
        resolve_spec(model)
        return True
    except ModelLoadError:
        return False


def _same_model(flag: str, recorded: str) -> bool:
    from goodserve.diagnose.model_shape import resolve_spec

    return flag == recorded or resolve_spec(flag).name == resolve_spec(recorded).name


def _first_given(*values: bool | None) -> bool | None:
    return next((value for value in values if value is not None), None)


def resolve(flags: dict[str, str | bool | None], engine: dict[str, str] | None, source: str) -> Assumptions:
    """flags: model, hardware, dtype, kv_cache_dtype, pipeline_micro_batches as given on the command
    line (None: not given)."""
    if not engine:
        hardware = flags["hardware"] or DEFAULT_HARDWARE
        dtype = flags["dtype"] or ("fp32" if hardware == "cpu" else "bf16")
        compute = dtype if dtype not in ("int8", "int4") else ("fp32" if hardware == "cpu" else "bf16")
        return Assumptions(flags["model"] or DEFAULT_MODEL, hardware, dtype, compute,
                           flags["kv_cache_dtype"] or compute,
                           _first_given(flags["pipeline_micro_batches"], engine_default_micro_batches(hardware)))
    recorded = _from_engine(engine)
    warnings = []
    if recorded["model"] and not _readable_here(recorded["model"]):
        warnings.append(f"the run's model {recorded['model']!r} cannot be read here: using --model "
                        f"{flags['model'] or DEFAULT_MODEL} for its shape")
        recorded["model"] = None
    for flag, key, same in (("--model", "model", _same_model), ("--hardware", "hardware", None),
                            ("--dtype", "weight_dtype", None), ("--kv-cache-dtype", "kv_dtype", None),
                            ("--pipeline-micro-batches", "micro_batches", None)):
        given, ran = flags[flag.removeprefix("--").replace("-", "_")], recorded[key]
        if given is None or ran is None or given == ran or (same and same(given, ran)):
            continue
        warnings.append(f"{flag} {given} differs from the engine the run used ({key} {ran}, from {source}): "
                        f"using {ran}")
    hardware = recorded["hardware"] or flags["hardware"]
    if hardware is None:
        warnings.append(f"the engine ran on {engine.get('device_name')!r}, not in the hardware table "
                        f"({', '.join(HARDWARE)}): give --hardware or --measure; assuming {DEFAULT_HARDWARE}")
        hardware = DEFAULT_HARDWARE
    micro_batches = _first_given(recorded["micro_batches"], flags["pipeline_micro_batches"],
                                 engine_default_micro_batches(hardware))
    return Assumptions(recorded["model"] or flags["model"] or DEFAULT_MODEL, hardware, recorded["weight_dtype"],
                       recorded["compute_dtype"], recorded["kv_dtype"], micro_batches, engine, source, warnings)
