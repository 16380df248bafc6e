"""The quantization default: a GGUF model on the CPU keeps its file's codes unless told
otherwise ('none' opts out); on CUDA, for other models and with other quantization options it stays
as asked. Resolution happens once the device is known (EngineConfig.resolved_quantization)."""

from __future__ import annotations

import argparse

import pytest

from goodserve import LLM
from goodserve.config import EngineConfig
from goodserve.engine_args import add_engine_arguments, engine_config_from_args
from goodserve.quant.linear import Int4Linear
from helpers import loaded_model


def resolved(device_type: str = "cpu", **options) -> str | None:
    config = EngineConfig(**options)
    config.validate()
    return config.resolved_quantization(device_type)


def test_a_gguf_model_on_the_cpu_keeps_its_codes_by_default():
    assert resolved() == "gguf"  # the embedded model is a GGUF file


@pytest.mark.parametrize("device_type,options", [
    ("cuda", {}),  # GPU behaviour unchanged: unquantized bfloat16
    ("cpu", {"quantization": "none"}),  # the opt-out
    ("cpu", {"model": "dummy:tiny"}),  # not a GGUF file
    ("cpu", {"quantized_checkpoint": "saved.pt"}),  # other quantization options: no gguf on top
    ("cpu", {"quantization_group_size": 64}),
    ("cpu", {"quantize_lm_head": True}),
])
def test_otherwise_no_quantization(device_type, options):
    assert resolved(device_type, **options) is None


@pytest.mark.parametrize("asked", ["int8", "int4", "gguf"])
def test_an_asked_quantization_stays(asked):
    assert resolved("cpu", quantization=asked) == asked


def test_none_is_a_cli_value():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--quantization", "none"])).quantization == "none"


def test_the_embedded_model_loads_with_gguf_layers_by_default_and_float_ones_with_none(embedded_gguf_llm,
                                                                                      embedded_llm):
    """embedded_gguf_llm is LLM("smollm2-135m") with no quantization asked, embedded_llm asks for none."""
    assert embedded_gguf_llm.engine.config.quantization == "gguf"
    assert isinstance(loaded_model(embedded_gguf_llm).model.layers[0].self_attn.qkv_proj, Int4Linear)
    assert embedded_llm.engine.config.quantization is None
    assert not isinstance(loaded_model(embedded_llm).model.layers[0].self_attn.qkv_proj, Int4Linear)


def test_cpu_int8_activations_is_an_engine_option_off_by_default(embedded_gguf_llm):
    """llama.cpp's int8 activation rows reach the GGUF layers only when the config asks for them."""
    def flags(llm):
        return {m.int8_activations for m in loaded_model(llm).modules() if isinstance(m, Int4Linear)}

    assert flags(embedded_gguf_llm) == {False}
    assert flags(LLM("smollm2-135m", num_kv_blocks=8, cpu_int8_activations=True)) == {True}


@pytest.mark.slow  # two loads of the embedded model for a log line of CPUs without AVX2
def test_cpu_int8_activations_without_the_kernel_says_it_keeps_float_rows(monkeypatch, caplog):
    """Where the build has no int8 kernel (it needs AVX2 or AVX-512BW) the option cannot act: the log says so."""
    from goodserve.native import int4_gemv

    monkeypatch.setattr(int4_gemv, "int8_dot_available", lambda: False)
    with caplog.at_level("WARNING", logger="goodserve.engine"):
        LLM("smollm2-135m", num_kv_blocks=8, cpu_int8_activations=True)
    assert any("keep float32 activation rows" in record.getMessage() for record in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="goodserve.engine"):
        LLM("smollm2-135m", num_kv_blocks=8)
    assert not any("activation rows" in record.getMessage() for record in caplog.records)
