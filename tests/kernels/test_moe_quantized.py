"""Quantized experts (model/moe.py QuantizedExperts: int8 per row, int4 per group): the fused MoE
kernel under TRITON_INTERPRET=1 and the CPU path against test_triton_moe's per-token reference run
on the dequantized weights; quantizing while filling in row blocks; and tiny Mixtral / Qwen3-MoE
models with --quantization int8 / int4 against transformers running the same models with every
quantized weight (attention projections, experts) replaced by its dequantized value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch

from goodserve.llm import LLM
from goodserve.model import moe
from goodserve.model.loader import load_model
from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice
from goodserve.quant.moe import moe_torch
from goodserve.quant.triton_moe import triton_fused_moe
from goodserve.quant import schemes
from test_families import FAMILIES, GREEDY, SETTINGS, hf_greedy, prompts, save_tiny_model, write_gguf
from test_triton_moe import DECODE_ROUTINGS, moe_inputs, reference, routed_inputs

transformers = pytest.importorskip("transformers")
# Log-probability, float32 end to end: ours are ~4e-7 from the reference; float experts move them by
# 2e-4 to 8e-4 on these models.
TOLERANCE = 2e-5


METHODS = {"int8": schemes.quantize_int8, "int4": lambda w: schemes.quantize_int4(w, 16)}


@pytest.fixture(autouse=True)
def int4_groups_of_16(monkeypatch):
    """The kernels take any group size dividing K; test_triton_moe's down projection has K = 48,
    which none of the engine's sizes (32 / 64 / 128) divide. 16 also puts four groups in a K tile."""
    monkeypatch.setattr(schemes, "INT4_GROUP_SIZES", (16, *schemes.INT4_GROUP_SIZES))


def quantized(stack: torch.Tensor, method: str):
    """(the codes of a stacked [rows, K] weight, the float weight they stand for)."""
    q = METHODS[method](stack)
    return q, schemes.dequantize(q)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_tokens", [1, 150])  # decode's 16-row blocks, prefill's 64-row ones
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_fused_moe_matches_the_dequantized_reference(num_tokens: int, dtype: torch.dtype, method: str):
    x, w13, w2, weights, ids = moe_inputs(num_tokens, 2, dtype, seed=2)
    (q13, f13), (q2, f2) = quantized(w13, method), quantized(w2, method)
    ours = triton_fused_moe(x, q13, q2, weights, ids, KernelChoice(triton=True))
    ref = reference(x, f13.to(dtype), f2.to(dtype), weights.to(dtype), ids)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.double(), ref, rtol=tolerance, atol=tolerance * ref.abs().max().item())


@pytest.mark.parametrize("routing", ["1 token top 8", "2 tokens sharing"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])  # bf16 fast
def test_int8_decode_gemv_matches_the_dequantized_reference_and_the_grouped_gemm(routing: str, dtype: torch.dtype):
    x, w13, w2, weights, ids = routed_inputs(DECODE_ROUTINGS[routing], dtype)
    (q13, f13), (q2, f2) = quantized(w13, "int8"), quantized(w2, "int8")
    gemv = triton_fused_moe(x, q13, q2, weights, ids, KernelChoice(triton=True), path="gemv")
    grouped = triton_fused_moe(x, q13, q2, weights, ids, KernelChoice(triton=True), path="grouped")
    ref = reference(x, f13.to(dtype), f2.to(dtype), weights.to(dtype), ids)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(gemv.double(), ref, rtol=tolerance, atol=tolerance * ref.abs().max().item())
    close = 1e-5 if dtype == torch.float32 else 2**-8  # see test_triton_moe's decode test
    torch.testing.assert_close(gemv, grouped, rtol=close, atol=close * grouped.abs().max().item())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_quantized_cpu_moe_matches_the_dequantized_reference(num_tokens: int, method: str):
    x, w13, w2, weights, ids = moe_inputs(num_tokens, 2, torch.float32, seed=3)
    (q13, f13), (q2, f2) = quantized(w13, method), quantized(w2, method)
    ours = moe_torch(x, q13, q2, weights, ids, TORCH_KERNELS)
    ref = reference(x, f13, f2, weights, ids)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_rows_quantized_in_blocks_get_the_whole_matrix_codes(monkeypatch, method: str):
    monkeypatch.setattr(moe, "QUANTIZE_CHUNK_BYTES", 3 * 4 * 64)  # three rows of 64 floats at a time
    weight = torch.randn(20, 64)
    codes = schemes.rows_of(schemes.Int4Weight(*schemes.empty_codes(method, 20, 64, 32).values(), 32)
                            if method == "int4" else schemes.Int8Weight(*schemes.empty_codes(method, 20, 64).values()),
                            slice(None))
    rows = moe.QuantizedRows(codes, 64)
    rows[0:8].copy_(weight[0:8])  # as a loader fills one expert's gate, then its up
    rows[8:20].copy_(weight[8:20])
    want = schemes.quantize_like(codes, weight)
    for part in schemes.CODE_PARTS[method]:
        assert torch.equal(getattr(codes, part), getattr(want, part))


def with_dequantized_weights(hf_model, method: str = "int8", group_size: int = 32, experts: bool = True):
    """transformers' model with the weights goodserve quantizes (attention projections, and the
    experts: stacked [E, out, in] there) replaced by their `method` values; router, norms, embeddings
    and lm_head kept. experts=False leaves the experts in float (what a model quantizing only its
    dense linears would compute)."""
    quantize = schemes.quantize_int8 if method == "int8" else lambda w: schemes.quantize_int4(w, group_size)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) \
                    or (experts and ".experts." in name):
                rows = param.reshape(-1, param.shape[-1])
                param.copy_(schemes.dequantize(quantize(rows)).reshape(param.shape))
    return hf_model


def hf_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Each of `tokens`' log-probability given the prompt and the tokens before it, in one forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def int4_ready(config):
    """The tiny config with expert widths int4's groups of 32 divide (test_families' 112 and 48 do not)."""
    config.intermediate_size, config.moe_intermediate_size = 128, 64
    return config


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_quantized_moe_gives_transformers_tokens_on_the_dequantized_weights(tmp_path: Path, family: str,
                                                                             method: str):
    config = FAMILIES[family]()
    save_tiny_model(int4_ready(config) if method == "int4" else config, tmp_path)
    load = lambda experts: with_dequantized_weights(  # noqa: E731
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval(), method, experts=experts)
    reference, float_experts = load(experts=True), load(experts=False)
    prompt_ids = prompts()
    llm = LLM(str(tmp_path), **(SETTINGS | {"quantization": method, "quantization_group_size": 32}))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], dataclasses.replace(GREEDY, logprobs=0))
    worst, float_worst = 0.0, 0.0
    for prompt, out in zip(prompt_ids, outputs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(reference, prompt)
        ours = torch.tensor([step[token].logprob for step, token in zip(out.outputs[0].logprobs, tokens)],
                            dtype=torch.float64)
        worst = max(worst, (ours - hf_logprobs(reference, prompt, tokens)).abs().max().item())
        float_worst = max(float_worst, (ours - hf_logprobs(float_experts, prompt, tokens)).abs().max().item())
    assert worst < TOLERANCE
    assert float_worst > 5 * TOLERANCE  # float experts would be told apart: the check can fail


def test_int8_experts_hold_codes_not_float_stacks(tmp_path: Path):
    save_tiny_model(FAMILIES["mixtral"](), tmp_path)
    model = load_model(str(tmp_path), torch.float32, "cpu", quantization="int8").model
    experts = [m.experts for m in model.modules() if isinstance(m, moe.SparseMoE)]
    assert len(experts) == 2 and all(isinstance(e, moe.QuantizedExperts) for e in experts)
    assert experts[0].w13_qweight.dtype == torch.int8 and experts[0].w2_qweight.dtype == torch.int8
    assert not any(".experts." in name for name, _ in model.named_parameters())


def test_int8_moe_from_gguf_gives_the_hf_directory_tokens(tmp_path: Path):
    """The GGUF loader fills the experts one [E, N, K] tensor per projection, expert by expert: the
    same codes as the Hugging Face loader's tensor per expert, hence the same tokens (the directory's
    int8 engine is checked against transformers above)."""
    hf_model = save_tiny_model(FAMILIES["mixtral"](), tmp_path)
    path = tmp_path / "tiny-moe.gguf"
    write_gguf(hf_model, tmp_path, gguf.MODEL_ARCH.LLAMA, path)
    requests = [{"prompt_token_ids": p} for p in prompts()]
    params = dataclasses.replace(GREEDY, logprobs=0)
    from_dir, from_gguf = (LLM(name, **(SETTINGS | {"quantization": "int8"})).generate(requests, params)
                           for name in (str(tmp_path), str(path)))
    for a, b in zip(from_dir, from_gguf):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert [x.logprob for x in step_a.values()] == pytest.approx([x.logprob for x in step_b.values()], abs=1e-5)
