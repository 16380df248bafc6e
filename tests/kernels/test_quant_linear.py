"""Int8Linear / Int4Linear on the CPU equal nn.Linear on the dequantized weight; quantize_model swaps
exactly the transformer projections (and lm_head, int8, when asked: the tied embedding keeps its
float table); a saved quantized checkpoint reloads bit-identically and says what its lm_head is."""

import pytest
import safetensors.torch
import torch
from torch import nn

from goodserve import LLM, SamplingParams
from goodserve.cli import main
from goodserve.errors import InvalidRequestError, ModelLoadError
from goodserve.model.llama import LlamaForCausalLM
from goodserve.model.spec import ModelSpec
from goodserve.quant import linear as qlinear
from goodserve.quant.apply import quantize_model
from goodserve.quant.checkpoint import load_quantized_into, read_metadata, save_quantized
from goodserve.quant import schemes
from goodserve.quant.linear import (TINYGEMM_CHECK_MAX_REL_ERROR, Int4Linear, Int8Linear, int4_scales_and_zeros,
                                    tinygemm_inner_k_tiles, tinygemm_nibbles)
from helpers import loaded_model

TINY = ModelSpec(name="tiny", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)


def _reference(module, x):
    return nn.functional.linear(x, module.dequantize(x.dtype), module.bias)


@pytest.mark.parametrize("rows", [1, qlinear.CPU_PACKED_MAX_M, 17])  # packed-kernel and dequantize paths
@pytest.mark.parametrize("out_features", [48, 40])  # 40: the int4 CPU kernel's N % 16 fallback
@pytest.mark.parametrize("make,float_tolerance", [(Int8Linear.from_linear, 0.02),
                                                  (lambda lin: Int4Linear.from_linear(lin, 32), 0.2)])
def test_cpu_forward_matches_dequantized_linear(rows, out_features, make, float_tolerance):
    torch.manual_seed(rows + out_features)
    lin = nn.Linear(96, out_features, bias=True)
    module = make(lin)
    x = torch.randn(2, rows, 96)
    out = module(x)
    assert out.shape == (2, rows, out_features)
    torch.testing.assert_close(out, _reference(module, x), rtol=1e-4, atol=1e-4)
    # and close to the float layer it replaced
    assert (out - lin(x)).abs().max() < float_tolerance


@pytest.mark.parametrize("rows", [1, 5, qlinear.CPU_BF16_KERNEL_MAX_M, qlinear.CPU_BF16_KERNEL_MAX_M + 1])
def test_bf16_kernel_layers_take_decode_batches_and_dequantize_longer_calls(monkeypatch, rows):
    """GGUF layers (bf16_cpu_kernel) send up to CPU_BF16_KERNEL_MAX_M rows to the int4 kernel on
    bf16-rounded rows; longer calls (prefill chunks) stay exact."""
    torch.manual_seed(rows)
    module = Int4Linear.from_linear(nn.Linear(96, 48, bias=False), 32)
    module.bf16_cpu_kernel = True
    paths = []
    for name in ("_cpu_packed_matmul", "_dequantized_matmul"):
        method = getattr(module, name)
        monkeypatch.setattr(module, name, lambda x, name=name, method=method: paths.append(name) or method(x))
    x = torch.randn(rows, 96)
    out = module(x)
    kernel = rows <= qlinear.CPU_BF16_KERNEL_MAX_M
    assert paths == ["_cpu_packed_matmul" if kernel else "_dequantized_matmul"]
    tolerance = 3e-2 if kernel else 1e-4  # bf16 rows, scales and output on the kernel path
    torch.testing.assert_close(out, _reference(module, x), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("make", [Int8Linear.from_linear, lambda lin: Int4Linear.from_linear(lin, 32)])
def test_many_rows_dequantize_a_block_of_output_rows_at_a_time(monkeypatch, make):
    """An int8 lm_head would be 1 GB in bf16: the dequantize path bounds its float copy."""
    monkeypatch.setattr(qlinear, "DEQUANT_CHUNK_BYTES", 96 * 4 * 7)  # 7 output rows of 96 floats
    torch.manual_seed(9)
    module = make(nn.Linear(96, 40, bias=True))
    x = torch.randn(17, 96)
    torch.testing.assert_close(module(x), _reference(module, x), rtol=1e-4, atol=1e-4)


def test_int4_cpu_layout_follows_reloaded_codes():
    torch.manual_seed(0)
    a, b = Int4Linear.from_linear(nn.Linear(64, 32), 32), Int4Linear.from_linear(nn.Linear(64, 32), 32)
    x = torch.randn(1, 64)
    a(x)  # builds a's CPU kernel layout
    a.load_state_dict(b.state_dict())
    torch.testing.assert_close(a(x), _reference(b, x), rtol=1e-4, atol=1e-4)


def _tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(TINY)
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_model_swaps_the_projections_only(method):
    model = quantize_model(_tiny_model(0), method, group_size=32)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")}
    expected = "Int8Linear" if method == "int8" else "Int4Linear"
    assert sorted(set(kinds.values())) == sorted({expected, "Linear"})
    assert kinds["lm_head"] == "Linear" and sum(v == expected for v in kinds.values()) == 8
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_quantize_model_refuses_bad_input_and_leaves_model_untouched():
    model = _tiny_model(0)
    with pytest.raises(InvalidRequestError, match="does not divide"):
        quantize_model(model, "int4", group_size=128)  # hidden size 64
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, nn.Linear)
    with pytest.raises(InvalidRequestError, match="quantization must be one of"):
        quantize_model(model, "int3")
    with pytest.raises(InvalidRequestError, match="float64"):
        quantize_model(model.double(), "int8")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_checkpoint_reloads_bit_identically(tmp_path, method):
    path = tmp_path / "q.safetensors"
    source = quantize_model(_tiny_model(0), method, group_size=32)
    save_quantized(source, path, revision="r1")
    target = load_quantized_into(_tiny_model(1), path, revision="r1")  # other random weights first
    saved, loaded = source.state_dict(), target.state_dict()
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_checkpoint_of_another_model_is_rejected(tmp_path):
    path = tmp_path / "q.safetensors"
    save_quantized(quantize_model(_tiny_model(0), "int8"), path, revision="r1")
    with pytest.raises(ModelLoadError, match="other weights"):
        load_quantized_into(_tiny_model(0), path, revision="r2")
    other = LlamaForCausalLM(ModelSpec(**{**TINY.__dict__, "name": "wider", "intermediate_size": 256}))
    with pytest.raises(ModelLoadError, match="another model .*'tiny'"):
        load_quantized_into(other, path, revision="r1")
    plain = tmp_path / "plain.safetensors"
    plain.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="not a readable safetensors"):
        load_quantized_into(_tiny_model(0), plain, revision="r1")


def test_automatic_group_size_is_the_largest_that_divides_every_layer():
    model = quantize_model(_tiny_model(0), "int4", group_size=None)  # hidden 64, intermediate 128
    sizes = {m.group_size for m in model.modules() if isinstance(m, Int4Linear)}
    assert sizes == {64}


def _tinygemm_dequantize(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Plain-torch transcription of tinygemm's reading of its inputs (torch int4mm.cu, and gpt-fast /
    torchao's packing): byte j of a row holds column 2j in its high nibble and 2j + 1 in its low
    one; w = (code - 8) * scale + zero, with scale, zero = scales_and_zeros[k // group_size, n]."""
    codes = torch.stack([nibbles >> 4, nibbles & 0xF], dim=-1).reshape(nibbles.shape[0], -1).float()
    per_column = scales_and_zeros.float().repeat_interleave(group_size, dim=0).transpose(0, 1)  # [N, K, 2]
    return (codes - 8) * per_column[..., 0] + per_column[..., 1]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("group_size", [32, 128])
def test_tinygemm_conversion_reproduces_our_dequantized_weight(group_size):
    torch.manual_seed(group_size)
    weight = torch.randn(24, 256) * 0.05 + 0.02  # offset: zero points must matter
    q = schemes.quantize_int4(weight, group_size)
    ours = schemes.dequantize_int4(q)
    scales_and_zeros = int4_scales_and_zeros(q.scales, q.zeros)
    assert scales_and_zeros.shape == (256 // group_size, 24, 2)
    exact = _tinygemm_dequantize(tinygemm_nibbles(q.qweight), scales_and_zeros, group_size)
    torch.testing.assert_close(exact, ours, rtol=0, atol=1e-6)  # float32: z + 8 s - 8 s
    # the kernel holds scales and zeros in bfloat16: close, and far inside the first-use check's bound
    rounded = _tinygemm_dequantize(tinygemm_nibbles(q.qweight), scales_and_zeros.to(torch.bfloat16), group_size)
    assert _relative_error(rounded, ours) < TINYGEMM_CHECK_MAX_REL_ERROR / 5
    # ... which a wrong nibble order (our own, unconverted) or zero point (ours, no + 8 s) fails
    assert _relative_error(_tinygemm_dequantize(q.qweight, scales_and_zeros, group_size), ours) \
        > 5 * TINYGEMM_CHECK_MAX_REL_ERROR
    no_offset = torch.stack([q.scales, q.zeros], dim=-1).transpose(0, 1)
    assert _relative_error(_tinygemm_dequantize(tinygemm_nibbles(q.qweight), no_offset, group_size), ours) \
        > 5 * TINYGEMM_CHECK_MAX_REL_ERROR


def test_tinygemm_nibble_swap_round_trips_bytes():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(tinygemm_nibbles(tinygemm_nibbles(every_byte)), every_byte)
    assert tinygemm_nibbles(torch.tensor([[0x21]], dtype=torch.uint8)).item() == 0x12


def test_tinygemm_shape_limits():
    assert tinygemm_inner_k_tiles(4096, 6144, 128) == 8 and tinygemm_inner_k_tiles(14336, 4096, 128) == 8
    assert tinygemm_inner_k_tiles(576, 1536, 64) == 4  # smollm2: 576 = 16 * 36
    assert tinygemm_inner_k_tiles(96, 64, 32) == 2
    assert tinygemm_inner_k_tiles(4096, 4100, 128) is None  # N not a multiple of 8
    assert tinygemm_inner_k_tiles(4096, 4096, 16) is None


def test_int4_checkpoint_keeps_no_kernel_layout(tmp_path):
    """The kernels' packed copies live outside the state dict, so checkpoints hold our codes only."""
    layer = Int4Linear.from_linear(nn.Linear(64, 32, bias=False), 32)
    layer(torch.randn(1, 64))  # builds the CPU kernel layout
    assert sorted(layer.state_dict()) == ["qweight", "scales", "zeros"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tied_lm_head_gets_int8_codes_and_the_embedding_keeps_its_table(method):
    model = _tiny_model(0)
    table = model.model.embed_tokens.weight.clone()
    hidden = torch.randn(5, TINY.hidden_size)
    float_logits = model.compute_logits(hidden)
    quantize_model(model, method, group_size=32, lm_head=True)
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8Linear if method == "int8" else Int4Linear)
    assert isinstance(model.model.embed_tokens.weight, nn.Parameter)
    assert torch.equal(model.model.embed_tokens.weight, table)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert ((logits - float_logits).norm() / float_logits.norm()).item() < 1e-2


def test_int4_lm_head_gives_the_logits_of_its_dequantized_codes():
    """lm_head_method int4: an Int4Linear of the layers' group size whose logits are hidden @ its
    dequantized codes (float32, so to float32 rounding), within int4's error of the float logits."""
    model = _tiny_model(0)
    hidden = torch.randn(5, TINY.hidden_size)
    float_logits = model.compute_logits(hidden)
    quantize_model(model, "int4", group_size=32, lm_head=True, lm_head_method="int4")
    head = model.lm_head
    assert isinstance(head, Int4Linear) and head.group_size == 32
    logits = model.compute_logits(hidden)
    reference = hidden.double() @ head.dequantize(torch.float64).T
    assert ((logits.double() - reference).norm() / reference.norm()).item() < 1e-5
    assert ((logits - float_logits).norm() / float_logits.norm()).item() < 0.15
    with pytest.raises(InvalidRequestError, match="int4 lm_head needs int4 layers"):
        quantize_model(_tiny_model(0), "int8", lm_head=True, lm_head_method="int4")


def test_lm_head_is_left_alone_by_default_and_checked_before_anything_changes():
    model = quantize_model(_tiny_model(0), "int8")
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    model = _tiny_model(0)
    model.lm_head = nn.Identity()
    with pytest.raises(InvalidRequestError, match="no float nn.Linear lm_head"):
        quantize_model(model, "int8", lm_head=True)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, nn.Linear)


@pytest.mark.slow  # builds the embedded model's engine (~6 s)
def test_int8_lm_head_on_real_weights_keeps_the_logits(embedded_llm):
    """smollm2's own (tied) output table: its rows peak at ~5x their RMS, so an int8 step is ~4% of
    the RMS and the weights (and logits) move by ~1.2%."""
    table = loaded_model(embedded_llm).model.embed_tokens.weight.detach()
    lm_head = nn.Linear(table.shape[1], table.shape[0], bias=False)
    lm_head.weight = nn.Parameter(table, requires_grad=False)
    quantized = Int8Linear.from_linear(lm_head)
    torch.manual_seed(0)
    hidden = torch.randn(8, table.shape[1])
    ref, out = lm_head(hidden), quantized(hidden)
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_checkpoint_with_lm_head_reloads_bit_identically_and_refuses_a_mismatch(tmp_path, method):
    path = tmp_path / "q.safetensors"
    source = quantize_model(_tiny_model(0), method, group_size=32, lm_head=True)
    save_quantized(source, path, revision="r1")
    assert read_metadata(path)["lm_head"] == "int8"
    target = load_quantized_into(_tiny_model(1), path, revision="r1", quantize_lm_head=True)
    saved, loaded = source.state_dict(), target.state_dict()
    assert saved.keys() == loaded.keys() and "lm_head.qweight" in saved
    for name, tensor in saved.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with pytest.raises(ModelLoadError, match="int8 lm_head.*--quantize-lm-head"):
        load_quantized_into(_tiny_model(1), path, revision="r1", quantize_lm_head=False)
    float_head = tmp_path / "float-head.safetensors"
    save_quantized(quantize_model(_tiny_model(0), method, group_size=32), float_head, revision="r1")
    with pytest.raises(ModelLoadError, match="float lm_head.*--no-quantize-lm-head"):
        load_quantized_into(_tiny_model(1), float_head, revision="r1", quantize_lm_head=True)


def test_checkpoint_with_an_int4_lm_head_reloads_it_and_refuses_another_method(tmp_path):
    path = tmp_path / "q4.safetensors"
    source = quantize_model(_tiny_model(0), "int4", group_size=32, lm_head=True, lm_head_method="int4")
    save_quantized(source, path, revision="r1")
    assert read_metadata(path)["lm_head"] == "int4"
    target = load_quantized_into(_tiny_model(1), path, revision="r1", quantize_lm_head=True,
                                 lm_head_quantization="int4")
    assert isinstance(target.lm_head, Int4Linear)
    assert all(torch.equal(target.state_dict()[name], tensor) for name, tensor in source.state_dict().items())
    with pytest.raises(ModelLoadError, match="int4 lm_head.*--lm-head-quantization int4"):
        load_quantized_into(_tiny_model(1), path, revision="r1", quantize_lm_head=True, lm_head_quantization="int8")


def test_checkpoint_from_before_the_option_loads_with_a_float_lm_head(tmp_path):
    path = tmp_path / "old.safetensors"
    save_quantized(quantize_model(_tiny_model(0), "int8"), path, revision="r1")
    metadata = {k: v for k, v in read_metadata(path).items() if k != "lm_head"}
    safetensors.torch.save_file(safetensors.torch.load_file(path), path, metadata=metadata)
    model = load_quantized_into(_tiny_model(1), path, revision="r1", quantize_lm_head=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_engine_serves_a_quantized_lm_head_at_load_or_from_a_checkpoint(tmp_path):
    """dummy:tiny-qwen ties its embeddings: same greedy tokens either way; the flag must match."""
    path = tmp_path / "tiny-int4-head.safetensors"
    assert main(["quantize", "--model", "dummy:tiny-qwen", "--quantization", "int4", "--group-size", "32",
                 "--lm-head", "--output", str(path)]) == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 13, 2]}
    at_load = LLM("dummy:tiny-qwen", quantization="int4", quantization_group_size=32, quantize_lm_head=True,
                  num_kv_blocks=16)
    from_file = LLM("dummy:tiny-qwen", quantized_checkpoint=str(path), quantize_lm_head=True, num_kv_blocks=16)
    expected = at_load.generate(prompt, params)[0].outputs[0].token_ids
    assert from_file.generate(prompt, params)[0].outputs[0].token_ids == expected
    assert isinstance(loaded_model(from_file).lm_head, Int8Linear)
    with pytest.raises(ModelLoadError, match="--quantize-lm-head"):
        LLM("dummy:tiny-qwen", quantized_checkpoint=str(path), num_kv_blocks=16)


def test_engine_serves_an_int4_lm_head_at_load_or_from_a_checkpoint(tmp_path):
    path = tmp_path / "tiny-int4-int4-head.safetensors"
    assert main(["quantize", "--model", "dummy:tiny-qwen", "--quantization", "int4", "--group-size", "32",
                 "--lm-head", "int4", "--output", str(path)]) == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 13, 2]}
    options = dict(quantize_lm_head=True, lm_head_quantization="int4", num_kv_blocks=16)
    at_load = LLM("dummy:tiny-qwen", quantization="int4", quantization_group_size=32, **options)
    from_file = LLM("dummy:tiny-qwen", quantized_checkpoint=str(path), **options)
    assert from_file.generate(prompt, params)[0].outputs[0].token_ids == \
        at_load.generate(prompt, params)[0].outputs[0].token_ids
    assert isinstance(loaded_model(at_load).lm_head, Int4Linear)
    with pytest.raises(InvalidRequestError, match="int4 lm_head"):
        LLM("dummy:tiny-qwen", quantization="int8", **options)
