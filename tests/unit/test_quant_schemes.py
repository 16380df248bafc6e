"""Quantize -> dequantize stays within each scheme's promised bound; bad group sizes are refused."""

import pytest
import torch

from goodserve.errors import InvalidRequestError
from goodserve.quant import schemes


@pytest.fixture
def weight():
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different ranges
    w[3] = 0.0  # an all-zero row must survive exactly
    w[5, :64] = 0.7  # a constant group too
    return w


def test_int8_error_within_half_a_step_per_row(weight):
    q = schemes.quantize_int8(weight)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    expected_scale = weight.abs().amax(dim=1) / 127  # hand-computed symmetric scale
    torch.testing.assert_close(q.scales[weight.abs().amax(1) > 0], expected_scale[weight.abs().amax(1) > 0])
    error = (schemes.dequantize_int8(q) - weight).abs()
    assert (error <= expected_scale[:, None] / 2 + 1e-6).all()
    assert torch.equal(schemes.dequantize_int8(q)[3], torch.zeros(256))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_within_half_a_step_per_group(weight, group_size):
    q = schemes.quantize_int4(weight, group_size)
    assert q.qweight.shape == (48, 128) and q.qweight.dtype == torch.uint8
    groups = weight.reshape(48, -1, group_size)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (schemes.dequantize_int4(q) - weight).abs().reshape(48, -1, group_size)
    assert (error <= step[..., None] / 2 + 1e-5).all()
    # the extremes of each group map to codes 0 and 15 exactly: the asymmetric range is used fully
    torch.testing.assert_close(schemes.dequantize_int4(q).reshape(48, -1, group_size).amin(-1), groups.amin(-1))
    assert torch.equal(schemes.dequantize_int4(q)[5, :64], torch.full((64,), 0.7))


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]])
    packed = schemes.pack_int4(codes)
    assert packed.tolist() == [[1 + (2 << 4), 15]]
    assert schemes.unpack_int4(packed).tolist() == codes.tolist()


def test_int4_beats_int8_bytes_and_int8_beats_int4_error(weight):
    q8, q4 = schemes.quantize_int8(weight), schemes.quantize_int4(weight, 64)
    assert q4.qweight.numel() * 2 == q8.qweight.numel()
    err8 = (schemes.dequantize_int8(q8) - weight).pow(2).mean()
    err4 = (schemes.dequantize_int4(q4) - weight).pow(2).mean()
    assert err8 < err4


def test_group_size_that_does_not_divide_is_refused():
    with pytest.raises(InvalidRequestError, match="does not divide .* 96"):
        schemes.quantize_int4(torch.randn(8, 96), 64)
    with pytest.raises(InvalidRequestError, match="one of"):
        schemes.quantize_int4(torch.randn(8, 96), 48)
