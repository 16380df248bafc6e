"""Context parallelism on the CPU (gloo, one process per rank): a prompt's prefill split over the
ranks (the zigzag split, K/V gathered every layer) gives one rank's greedy tokens, at prompt lengths
that do and do not divide by the ranks, batched, and in chunks beside decodes; an abort mid-prompt
leaves no block in use; a rank that dies ends the engine; settings it cannot serve are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from goodserve import LLM, SamplingParams
from goodserve.config import KernelOptions
from goodserve.errors import InvalidRequestError
from helpers import engine_of, shut_down
from test_families import save_tiny_model
from test_gemma import gemma3_config
from test_tensor_parallel import fast_timeout  # noqa: F401 (a fixture its tests use)
from test_tensor_parallel import SETTINGS, assert_a_dead_rank_1_ends_the_engine, assert_split_matches, greedy_tokens

# Lengths below 2N (run whole on rank 0), at it, and ones that leave remainders for 2 and 3 ranks.
LENGTHS = (2, 5, 6, 31, 64, 97)
PROMPTS = [{"prompt_token_ids": [3 + (7 * i + n) % 500 for i in range(n)]} for n in LENGTHS]
WHOLE_STEPS = {"max_num_batched_tokens": 512}  # every prompt in one step


def context_parallel(size: int, model: str = "dummy:tiny", **settings) -> LLM:
    return LLM(model, context_parallel_size=size, **(SETTINGS | settings))


def split_steps(llm: LLM) -> int:
    return engine_of(llm).stats().num_context_parallel_steps


@pytest.mark.parametrize(("size", "model"), [(2, "dummy:tiny"), (2, "dummy:tiny-llama3"), (3, "dummy:tiny")])
def test_split_prefill_gives_one_ranks_greedy_tokens(size, model):
    """Each prompt alone, then all in one batch, then again over the prefix cache's blocks."""
    whole = LLM(model, **(SETTINGS | WHOLE_STEPS))
    expected = greedy_tokens(whole, PROMPTS)
    llm = context_parallel(size, model, **WHOLE_STEPS)
    try:
        assert [greedy_tokens(llm, [prompt])[0] for prompt in PROMPTS] == expected
        alone = split_steps(llm)
        assert alone == sum(n >= 2 * size for n in LENGTHS)  # the others ran whole on every rank
        assert greedy_tokens(llm, PROMPTS) == expected
        assert split_steps(llm) == alone + 1
        assert greedy_tokens(llm, PROMPTS) == expected  # cached prefixes: blocks every rank holds
    finally:
        shut_down(llm)


def test_a_model_of_local_and_global_layers_keeps_one_pool_group_and_one_ranks_tokens(tmp_path):
    """Gemma 3 (five sliding-window layers to one global): one rank keeps a pool of layer groups,
    context-parallel ranks one group (their exchange of new K/V rows addresses one slot mapping)."""
    save_tiny_model(gemma3_config(), tmp_path)
    prompts = [{"prompt_token_ids": [i % 290 + 3 for i in p["prompt_token_ids"]]} for p in PROMPTS]  # its vocabulary
    assert_one_split_step_gives_one_ranks_tokens(str(tmp_path), prompts)


def assert_one_split_step_gives_one_ranks_tokens(model: str, prompts: list[dict], **settings) -> None:
    """The prompts in one step, split over two ranks: one rank's greedy tokens."""
    settings = WHOLE_STEPS | settings
    expected = greedy_tokens(LLM(model, **(SETTINGS | settings)), prompts)
    llm = context_parallel(2, model, **settings)
    try:
        assert greedy_tokens(llm, prompts) == expected
        assert split_steps(llm) == 1
    finally:
        shut_down(llm)


def test_chunked_prompts_beside_decodes_and_an_abort_match_one_rank():
    """Chunks of 16 tokens over a cached prefix, sharing steps with other sequences' decodes."""
    llm = context_parallel(2)
    assert_split_matches(LLM("dummy:tiny", **SETTINGS), llm)  # shuts llm down
    assert split_steps(llm) > 0


def test_int8_kv_cache_rows_travel_with_their_scales():
    assert_one_split_step_gives_one_ranks_tokens("dummy:tiny", PROMPTS, kv_cache_dtype="int8")


def test_triton_kernels_attend_the_pieces_as_the_torch_path_attends_whole_prompts():
    """Under Triton's interpreter, with RoPE fused into decode attention: a 4-token prompt over 2
    ranks is 1-token pieces only (a step that looks decode-only, yet must write and gather K/V first)."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 21)]
    expected = greedy_tokens(LLM("dummy:tiny", **(SETTINGS | WHOLE_STEPS)), prompts)
    llm = context_parallel(2, attention_backend="triton", kernels=KernelOptions(fuse_rotary_into_decode_attention=True),
                           **WHOLE_STEPS)
    try:
        assert [greedy_tokens(llm, [prompt])[0] for prompt in prompts] == expected
        assert split_steps(llm) == 2
    finally:
        shut_down(llm)


def test_seeded_sampling_draws_one_ranks_tokens():
    """The logits of a split prefill are one rank's: seeded samples from them too."""
    seeded = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True) for i in range(len(PROMPTS))]
    one_rank = LLM("dummy:tiny", **(SETTINGS | WHOLE_STEPS))
    expected = [out.outputs[0].token_ids for out in one_rank.generate(PROMPTS, seeded)]
    llm = context_parallel(2, **WHOLE_STEPS)
    try:
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, seeded)] == expected
    finally:
        shut_down(llm)


def test_a_rank_that_dies_ends_the_engine_with_a_clear_error():
    assert_a_dead_rank_1_ends_the_engine(context_parallel(2))


@pytest.mark.parametrize(("settings", "refused"), [
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size > 1"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size > 1"),
    ({"speculative_method": "ngram"}, "speculative decoding"),
    ({"speculative_model": "self:int8"}, "speculative decoding"),
])
def test_what_it_cannot_serve_yet_is_refused_before_any_rank_starts(settings, refused):
    with pytest.raises(InvalidRequestError, match=f"--context-parallel-size 2 cannot be combined with {refused}"):
        context_parallel(2, **settings)


def test_sizes_below_one_are_refused():
    with pytest.raises(InvalidRequestError, match="context_parallel_size must be at least 1"):
        context_parallel(0)


BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "gpu_context_parallel.py"


def run_benchmark(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OUT": str(out), "PYTHONPATH": os.pathsep.join(
        [str(BENCHMARK.parents[1] / "src"), str(BENCHMARK.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(BENCHMARK), "--smoke", *args], env=env, timeout=300,
                          capture_output=True, text=True)


def test_the_gpu_benchmark_runs_its_cpu_smoke_path(tmp_path):
    """benchmarks/gpu_context_parallel.py end to end on gloo: every size's tokens are one rank's."""
    run_benchmark(tmp_path, "--sizes", "1,2", "--lengths", "9,40", "--repeats", "1").check_returncode()
    result = json.loads((tmp_path / "gpu_context_parallel_smoke.json").read_text())
    one, two = result["sizes"]
    assert (one["split_steps"], two["split_steps"]) == (0, 4)  # the two warm-ups and the two lengths
    assert [row["tokens"] for row in two["lengths"]] == [row["tokens"] for row in one["lengths"]]


def test_the_gpu_benchmark_needs_the_baseline_among_its_sizes(tmp_path):
    refused = run_benchmark(tmp_path, "--sizes", "2,3")
    assert refused.returncode == 2 and "--sizes must include 1" in refused.stderr
