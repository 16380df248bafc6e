"""`goodserve quantize`: quantize a model's weights once and save them, so serving skips that work."""

from __future__ import annotations

import argparse
from pathlib import Path

from goodserve.config import LM_HEAD_QUANTIZATIONS, WEIGHT_QUANTIZATIONS
from goodserve.model_names import EMBEDDED_MODEL


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="quantize a model's weights (int8 / int4 / fp8) and save a checkpoint",
        description="Load a model, quantize its linear layers and save them as safetensors; serve it "
                    "with `goodserve serve --model M --quantized-checkpoint FILE`.",
    )
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="the model the checkpoint is made from")
    parser.add_argument("--quantization", choices=WEIGHT_QUANTIZATIONS, required=True)
    parser.add_argument("--group-size", type=int, default=None, help="int4 group (default: largest that divides)")
    parser.add_argument("--awq", action="store_true", help="activation-aware scaling before rounding")
    parser.add_argument("--lm-head", nargs="?", const="int8", default=None, choices=LM_HEAD_QUANTIZATIONS,
                        help="quantize lm_head too: int8 per channel (the default method) or int4 (the layers' "
                             "group size, with --quantization int4); serve with --quantize-lm-head "
                             "[--lm-head-quantization int4]")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", required=True, help="the .safetensors file to write")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from goodserve.errors import InvalidRequestError

    if not Path(args.output).expanduser().parent.is_dir():
        raise InvalidRequestError(f"cannot write {args.output}: its folder does not exist")
    from goodserve.model.loader import load_spec

    if load_spec(args.model).is_moe:  # the checkpoint format holds linears, not stacked experts
        raise InvalidRequestError(f"{args.model} is a mixture of experts: a quantized checkpoint cannot hold its "
                                  "experts; serve it with --quantization int8 or int4, which quantizes them while loading")

    from goodserve.config import EngineConfig
    from goodserve.engine.setup.config_resolution import resolve_for_device, torch_dtype
    from goodserve.engine.setup.model_builder import apply_quantization
    from goodserve.model.loader import load_model
    from goodserve.quant.checkpoint import save_quantized

    config = resolve_for_device(EngineConfig(
        model=args.model, device=args.device, quantization=args.quantization,
        quantization_group_size=args.group_size, quantization_awq=args.awq, quantize_lm_head=args.lm_head is not None,
        lm_head_quantization=args.lm_head or "int8"))
    loaded = load_model(args.model, torch_dtype(config), config.device)
    with torch.inference_mode():
        apply_quantization(loaded, config)
    save_quantized(loaded.model, args.output, loaded.revision)
    print(f"wrote {args.output}")
    return 0
