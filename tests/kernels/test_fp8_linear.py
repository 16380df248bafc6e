"""Fp8Linear on the CPU (torch's reference _scaled_mm): weights per output channel and activations per
token in float8_e4m3fn, against a float matmul of the same fp8 values computed here independently;
the refusals (GPU capability, shapes, devices, MoE, option combinations); a saved fp8 checkpoint
reloads bit-identically."""

import dataclasses

import pytest
import torch
from torch import nn

from goodserve.config import EngineConfig
from goodserve.errors import InvalidRequestError
from goodserve.model.llama import LlamaForCausalLM, build_empty_model
from goodserve.model.presets import get_preset
from goodserve.quant.apply import quantize_model
from goodserve.quant.checkpoint import load_quantized_into, read_metadata, save_quantized
from goodserve.quant.fp8_linear import (Fp8Linear, check_fp8_capability, check_fp8_device, quantize_rows_torch)
from test_quant_linear import TINY, _tiny_model

E4M3_MAX = 448.0
E4M3_MANTISSA_BITS = 3


def fp8_round(values: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest float8_e4m3fn value (normal range), computed without torch's fp8 cast:
    keep 3 mantissa bits, ties to even."""
    mantissa, exponent = torch.frexp(values)  # values = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
    step = torch.ldexp(torch.ones_like(values), exponent - 1 - E4M3_MANTISSA_BITS)
    smallest_normal_step = 2.0 ** (-6 - E4M3_MANTISSA_BITS)  # below 2^-6 e4m3 is subnormal: fixed steps
    step = torch.maximum(step, torch.full_like(step, smallest_normal_step))
    return torch.round(values / step) * step


def reference(x: torch.Tensor, module: Fp8Linear, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row scaled so its largest magnitude is 448, rounded to e4m3, times the stored weight's values.
    The scale is float32 amax times float32 1/448, as the layer computes it: bfloat16 rows hit exact
    ties between e4m3 values often, and which way a tie goes follows the scale's last bit."""
    rows = x.reshape(-1, x.shape[-1]).double()
    scales = (rows.abs().amax(dim=1, keepdim=True).float() * torch.tensor(1 / E4M3_MAX)).double()
    quantized = fp8_round((rows / scales).float()).double() * scales
    weight = module.qweight.double() * module.scales.double()[:, None]
    out = quantized @ weight.T + (0 if bias is None else bias.double())
    return out.reshape(*x.shape[:-1], -1)


def test_fp8_round_is_the_e4m3_cast():
    """The reference's rounding agrees with torch's cast on normal values (a check of the test itself)."""
    values = torch.randn(4096) * 40
    values = values[values.abs() > 2 ** -6]
    torch.testing.assert_close(fp8_round(values), values.to(torch.float8_e4m3fn).float(), rtol=0, atol=0)


def test_weight_codes_are_per_channel_e4m3():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    module = Fp8Linear.from_linear(lin)
    assert module.qweight.dtype == torch.float8_e4m3fn and module.scales.shape == (32,)
    torch.testing.assert_close(module.scales, lin.weight.abs().amax(dim=1) / E4M3_MAX)
    assert (module.qweight.float().abs().amax(dim=1) == E4M3_MAX).all()  # each row's largest weight onto 448
    # within half an e4m3 step (3 mantissa bits: 2^-4 relative) of each weight, or of e4m3's smallest step
    error = (module.dequantize() - lin.weight).abs()
    bound = lin.weight.abs() * 2 ** -4 + module.scales[:, None] * 2 ** -10
    assert (error <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_is_the_fp8_matmul_of_rounded_activations(dtype, rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 48, bias=bias).to(dtype)
    if bias:
        nn.init.normal_(lin.bias, std=0.5)
    module = Fp8Linear.from_linear(lin)
    x = torch.randn(2, rows, 96, dtype=dtype) * torch.logspace(-2, 1, 96).to(dtype)  # rows of uneven magnitudes
    out = module(x)
    assert out.shape == (2, rows, 48) and out.dtype == dtype
    want = reference(x, module, lin.bias if bias else None)
    # float32 accumulation of exact fp8 products; bfloat16 adds the output's rounding (2^-8 relative)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    # and near the float layer it replaced: two e4m3 roundings of a few percent each
    float_out = lin(x).double()
    assert (out.double() - float_out).norm() / float_out.norm() < 0.06


def test_activation_rows_scale_per_token_and_zero_rows_stay_zero():
    rows = torch.tensor([[0.0] * 16, [1.0] * 15 + [-8.0], [1e-3] * 16])
    codes, scales = quantize_rows_torch(rows)
    assert scales.shape == (3, 1) and scales.dtype == torch.float32
    assert torch.equal(codes[0].float(), torch.zeros(16))  # a padded row: no NaN from 0 / 0
    torch.testing.assert_close(scales[1:, 0], torch.tensor([8.0, 1e-3]) / E4M3_MAX)
    assert codes[1, -1].float() == -E4M3_MAX and codes[2].float().eq(E4M3_MAX).all()


def test_triton_kernel_scales_match_torch():
    """The CUDA kernel's per-token scales (run by Triton's interpreter here). Its codes are compared on
    the GPU (tests/gpu/test_gpu_fp8.py): the interpreter's float32 -> e4m3 cast drops the carry into the
    next exponent (125.7 becomes 64), so only the scales mean something on the CPU."""
    from goodserve.quant.triton_fp8 import quantize_rows_fp8

    torch.manual_seed(0)
    rows = torch.randn(5, 1500, dtype=torch.bfloat16) * torch.arange(1, 6, dtype=torch.bfloat16)[:, None]
    rows[2] = 0
    codes, scales = quantize_rows_fp8(rows)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == rows.shape
    torch.testing.assert_close(scales, quantize_rows_torch(rows)[1], rtol=0, atol=0)


@pytest.mark.parametrize("capability,ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                           ((10, 0), True)])
def test_capability_check(capability, ok):
    if ok:
        check_fp8_capability(capability)
    else:
        with pytest.raises(InvalidRequestError, match=r"compute capability 8\.9 or higher.*A100 has"):
            check_fp8_capability(capability, "A100")


def test_shapes_and_devices_it_cannot_run_are_refused():
    with pytest.raises(InvalidRequestError, match="multiples of 16.*40 -> 48"):
        Fp8Linear(40, 48)
    with pytest.raises(InvalidRequestError, match="multiples of 16.*down_proj"):
        quantize_model(LlamaForCausalLM(dataclasses.replace(TINY, intermediate_size=120)), "fp8")
    with pytest.raises(InvalidRequestError, match="not on mps"):
        check_fp8_device("mps")


def test_option_combinations_refused():
    for options in ({"quantization_awq": True}, {"quantization_group_size": 64}):
        with pytest.raises(InvalidRequestError, match="fp8.*neither"):
            EngineConfig(model="dummy:tiny", quantization="fp8", **options).validate()
    with pytest.raises(InvalidRequestError, match="int4 lm_head"):  # before the load, not after it
        EngineConfig(model="dummy:tiny", quantization="fp8", quantize_lm_head=True,
                     lm_head_quantization="int4").validate()
    with pytest.raises(InvalidRequestError, match="mixture of experts.*fp8"):
        build_empty_model(get_preset("tiny-moe"), torch.float32, "cpu", quantization="fp8")


def test_checkpoint_round_trip_is_bit_identical(tmp_path):
    path = tmp_path / "tiny-fp8.safetensors"
    source = quantize_model(_tiny_model(0), "fp8")
    save_quantized(source, path, revision="r1")
    assert read_metadata(path)["method"] == "fp8"
    target = load_quantized_into(_tiny_model(1), path, revision="r1")
    assert isinstance(target.model.layers[0].mlp.down_proj, Fp8Linear)
    loaded = target.state_dict()
    for name, tensor in source.state_dict().items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(_bits(loaded[name]), _bits(tensor)), name


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 compared by its bytes (torch.equal has no float8 kernel on the CPU)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
