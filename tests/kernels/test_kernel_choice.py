"""Each engine's kernel choice is its own (ops/kernel_choice.py): engines with different backends or
KernelOptions in one process each run their own kernels and give their own right tokens. The Triton
engines run in the interpreter (TRITON_INTERPRET=1, tests/conftest.py), so prompts stay short."""

from __future__ import annotations

import pytest

from goodserve import LLM, SamplingParams
from goodserve.config import KernelOptions
from goodserve.errors import InvalidRequestError
from goodserve.ops import triton_attention, triton_ops
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.quant.linear import Int4Linear
from helpers import loaded_model

TINY = {"model": "dummy:tiny", "num_kv_blocks": 16, "max_num_seqs": 2}
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [42, 7]}]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def greedy_tokens(llm: LLM, prompt: dict) -> list[int]:
    return llm.generate(prompt, GREEDY)[0].outputs[0].token_ids


@pytest.fixture
def triton_launches(monkeypatch) -> list[str]:
    """Names of the Triton launches the model's ops make (each op imports its kernel when called)."""
    launches = []
    for module, name in ((triton_ops, "triton_add_rms_norm"), (triton_attention, "triton_prefill_attention"),
                         (triton_attention, "triton_decode_attention")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: launches.append(_n) or _k(*a, **kw))
    return launches


def test_building_a_second_engine_leaves_the_first_ones_kernels(triton_launches):
    on_triton = LLM(**TINY, attention_backend="triton")
    on_torch = LLM(**TINY, attention_backend="torch")  # built after: must not switch the first one
    greedy_tokens(on_triton, PROMPTS[0])
    assert {"triton_add_rms_norm", "triton_prefill_attention", "triton_decode_attention"} <= set(triton_launches)
    launched = len(triton_launches)
    greedy_tokens(on_torch, PROMPTS[0])
    assert len(triton_launches) == launched  # the torch engine launched no Triton kernel
    assert loaded_model(on_triton).kernels.triton and not loaded_model(on_torch).kernels.triton


def test_engines_with_different_backends_used_in_turn_each_give_their_reference_tokens():
    reference = [greedy_tokens(LLM(**TINY, attention_backend="torch"), prompt) for prompt in PROMPTS]
    engines = [LLM(**TINY, attention_backend="triton"), LLM(**TINY, attention_backend="torch")]
    for prompt, want in zip(PROMPTS, reference):
        for llm in engines:  # alternately: each step of one engine between two of the other
            assert greedy_tokens(llm, prompt) == want


def test_kernel_options_reach_every_layer_of_their_engine_only():
    rows = LLM(**TINY, quantization="int4", kernels=KernelOptions(pdl=False, int4_one_row_kernel="rows"))
    default = LLM(**TINY, quantization="int4")
    for llm, kernel in ((rows, "rows"), (default, "tinygemm")):
        layers = [m for m in loaded_model(llm).modules() if isinstance(m, Int4Linear)]
        assert layers and {layer.one_row_kernel for layer in layers} == {kernel}
        assert all(m.kernels is loaded_model(llm).kernels for m in loaded_model(llm).modules() if hasattr(m, "kernels"))
    assert loaded_model(rows).kernels.options.int4_one_row_kernel == "rows"


def test_fused_silu_and_mul_reaches_the_gate_up_layer_it_routes_to_rows_repacked():
    """KernelOptions.int4_fused_silu_and_mul fuses SwiGLU where gate_up_proj's one-row kernel is
    rows_repacked; on the CPU the MLP still runs projection then activation, with the tokens of an
    engine without the option."""
    gate_up = (256, 64)  # dummy:tiny's (2 x intermediate, hidden)
    options = KernelOptions(int4_fused_silu_and_mul=True, int4_one_row_kernel_by_shape={gate_up: "rows_repacked"})
    fused = LLM(**TINY, quantization="int4", kernels=options)
    model = loaded_model(fused)
    fusing = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
              if isinstance(m, Int4Linear) and m.fuses_silu}
    assert fusing == {"gate_up_proj"}
    assert greedy_tokens(fused, PROMPTS[0]) == greedy_tokens(LLM(**TINY, quantization="int4"), PROMPTS[0])


def test_decode_attention_tuning_is_chosen_by_batch_size():
    table = {1: {"DIRECT_KEYS": 512}, 16: {"BLOCK_N": 32}}
    choice = KernelChoice(triton=True, options=KernelOptions(decode_attention_tuning_by_batch=table))
    assert [choice.decode_attention_tuning(b) for b in (1, 2, 16, 17)] == [table[1], table[16], table[16], None]


def test_fused_rotary_decode_gives_the_reference_tokens(monkeypatch):
    """With RoPE + the cache write fused into decode attention, every decode step takes the fused launch
    (prefill steps the separate kernel) and the greedy tokens are the torch engine's."""
    fused_launches = []
    kernel = triton_attention.triton_decode_attention
    monkeypatch.setattr(triton_attention, "triton_decode_attention",
                        lambda *a, **kw: fused_launches.append(kw.get("new_tokens") is not None) or kernel(*a, **kw))
    options = KernelOptions(fuse_rotary_into_decode_attention=True,
                            decode_attention_tuning_by_batch={2: {"DIRECT_KEYS": 3}})
    fused = LLM(**TINY, attention_backend="triton", kernels=options)
    reference = LLM(**TINY, attention_backend="torch")
    for prompt in PROMPTS:
        assert greedy_tokens(fused, prompt) == greedy_tokens(reference, prompt)
    assert fused_launches and all(fused_launches)


@pytest.mark.parametrize("table", [{0: {}}, {1: {"BLOCKN": 64}}])
def test_decode_attention_tuning_table_is_checked(table):
    with pytest.raises(InvalidRequestError, match="decode_attention_tuning_by_batch"):
        KernelOptions(decode_attention_tuning_by_batch=table).validate()
