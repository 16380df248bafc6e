"""Load + quantize + kernel choice: one function that returns the model ready to run as the
(resolved) config says."""

from __future__ import annotations

import dataclasses
import logging

import torch

from goodserve.config import EngineConfig
from goodserve.engine.setup.config_resolution import torch_dtype
from goodserve.engine.setup.device_memory import release_dropped_memory
from goodserve.errors import InvalidRequestError
from goodserve.model.loader import LoadedModel, load_model
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.tensor_parallel import TensorParallel
from goodserve.model.tokenizer import read_chat_template
from goodserve.model.tokenizer_loader import load_tokenizer
from goodserve.ops.cpu_linear import pack_linears_for_cpu
from goodserve.ops.kernel_choice import KernelChoice, choose_kernels, use_kernels

logger = logging.getLogger("goodserve.engine")


def build_model(config: EngineConfig, tp: TensorParallel = TensorParallel(),
                pp: PipelineParallel = PipelineParallel()) -> LoadedModel:
    """The model (this rank's share of it). Its modules hold their KernelChoice (ops/kernel_choice.py):
    no process-wide setting."""
    device = torch.device(config.device)
    chat_template = read_chat_template(config.chat_template) if config.chat_template else None  # before the load
    if config.quantization == "fp8":  # a GPU without FP8 tensor cores is refused before the load
        from goodserve.quant.fp8_linear import check_fp8_device

        check_fp8_device(device)
    release_dropped_memory()  # an engine dropped before this one leaves this one room to load
    torch.manual_seed(config.seed)
    kernels = choose_kernels(config.attention_backend, config.kernels, device)
    loaded = load_model(config.model, torch_dtype(config), device, seed=config.seed,
                        keep_gguf_quantization=config.quantization == "gguf", tp=tp, pp=pp,
                        quantization=config.quantization, group_size=config.quantization_group_size)
    apply_quantization(loaded, config)
    specialize_linears(loaded.model, device, config, kernels)
    use_kernels(loaded.model, kernels)
    if config.tokenizer:
        loaded = dataclasses.replace(loaded, tokenizer=load_tokenizer(config.tokenizer, loaded.spec))
    if chat_template:
        if loaded.tokenizer is None:
            raise InvalidRequestError("--chat-template needs a tokenizer: this model has none (give --tokenizer)")
        loaded = dataclasses.replace(loaded, tokenizer=loaded.tokenizer.with_chat_template(chat_template))
    return loaded


def apply_quantization(loaded: LoadedModel, config: EngineConfig) -> None:
    """Weight-only quantization in place: from a saved checkpoint, or computed at load time.
    (quantization 'gguf' happens in the loader: the file's own codes.)"""
    if config.quantization == "gguf":
        return
    # The experts took their codes while loading (model/moe.py); the attention linears (and lm_head) take them here.
    if loaded.spec.is_moe and (config.quantized_checkpoint or config.quantization_awq):
        raise InvalidRequestError(f"{loaded.spec.name} is a mixture of experts: "
                                  f"{'a quantized checkpoint' if config.quantized_checkpoint else 'quantization_awq'} "
                                  "is not supported for it; use --quantization int8 or int4")
    if config.quantized_checkpoint:
        from goodserve.quant.checkpoint import load_quantized_into

        load_quantized_into(loaded.model, config.quantized_checkpoint, loaded.revision, config.quantize_lm_head,
                            config.lm_head_quantization)
    elif config.quantization:
        from goodserve.quant.apply import quantize_model
        from goodserve.quant.awq import default_calibration_text

        calibration = None
        if config.quantization_awq:
            if loaded.tokenizer is None:
                raise InvalidRequestError("quantization_awq needs a tokenizer for its calibration text")
            calibration = loaded.tokenizer.encode(default_calibration_text())
        quantize_model(loaded.model, config.quantization, config.quantization_group_size, calibration,
                       lm_head=config.quantize_lm_head and loaded.model.pp.is_last,  # the last stage holds it
                       lm_head_method=config.lm_head_quantization)


def specialize_linears(model, device: torch.device, config: EngineConfig, kernels: KernelChoice) -> None:
    """Once the weights are final, the fastest kernel per linear: oneDNN packed weights for float32
    on the CPU, and for int4 layers one native call per decode step; on CUDA, the Triton GEMV for
    one-row matmuls where it was measured to beat cuBLAS."""
    if device.type == "cpu":
        from goodserve.model import native_decode

        if config.cpu_int8_activations:
            from goodserve.native.int4_gemv import int8_dot_available
            from goodserve.quant.gguf_native import use_int8_activations

            if not int8_dot_available():
                logger.warning("cpu_int8_activations: this CPU (or build) has no int8 kernel (it needs AVX2 or AVX-512BW); "
                               "the GGUF layers keep float32 activation rows")
            use_int8_activations(model)
        pack_linears_for_cpu(model)
        # It runs all layers in one native call: no room for the all-reduces, nor for a stage's hand-off.
        if model.tp.size == 1 and model.pp.size == 1:
            native_decode.attach(model)
    elif kernels.triton:
        from goodserve.ops.gemv_linear import route_decode_rows_to_gemv

        route_decode_rows_to_gemv(model, kernels)
