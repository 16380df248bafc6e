"""Tensor parallelism on the CPU (gloo, one process per rank): the split model gives the greedy
tokens of the whole one, whichever way its KV heads fall (split, or replicated where the ranks
outnumber them); sizes that split no head are refused; aborts leak no block; a lost rank ends the
engine with a clear error instead of a hang; ranks started apart (`goodserve worker`, as on a second
host) join through env:// like torchrun's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from goodserve import LLM, SamplingParams
from goodserve.errors import EngineDeadError, InvalidRequestError
from goodserve.model.dummy_loader import load_dummy
from goodserve.model.llama import build_empty_model
from goodserve.model.presets import get_preset
from goodserve.model.tensor_parallel import TensorParallel, check_tensor_parallel_size
from goodserve.ports import free_port
from goodserve.quant.apply import quantize_model
from helpers import executor_of, shut_down, worker_processes

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30, 2)]
# Alone, its first chunks sample nothing: no logits rows to gather.
LONG_PROMPT = [{"prompt_token_ids": list(range(3, 43))}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Small prefill chunks: prompts span several steps, beside other sequences' decodes.
SETTINGS = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 64, "max_num_batched_tokens": 16}


def greedy_tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


@pytest.fixture(autouse=True)
def fast_timeout(monkeypatch):
    # The ranks inherit it: a lost peer fails a collective within seconds, not minutes.
    monkeypatch.setenv("GOODSERVE_DISTRIBUTED_TIMEOUT_S", "20")


def tensor_parallel(model: str, size: int, **settings) -> LLM:
    return LLM(model, tensor_parallel_size=size, **(SETTINGS | settings))


def test_sizes_that_split_no_head_are_refused_with_the_sizes_that_do():
    with pytest.raises(InvalidRequestError, match="valid sizes: 1, 3$"):
        check_tensor_parallel_size(get_preset("smollm2-135m"), 2)
    for size in (2, 4):  # 4 heads, 2 KV heads: at 4 each KV head serves two ranks
        check_tensor_parallel_size(get_preset("tiny"), size)


def test_vocab_shards_with_padding_look_up_and_score_as_the_whole_table():
    spec = dataclasses.replace(get_preset("tiny"), vocab_size=509)  # 255 rows a rank, the last one padded
    whole = load_dummy(spec, torch.float32, "cpu", seed=0)
    shards = [load_dummy(spec, torch.float32, "cpu", seed=0, tp=TensorParallel(rank, 2)) for rank in range(2)]
    ids = torch.tensor([0, 254, 255, 508])
    # One process: the lookup's all-reduce is the identity, so summing the ranks' lookups here is its sum.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        looked_up = sum(shard.model.embed_tokens(ids) for shard in shards)
    finally:
        dist.destroy_process_group()
    assert torch.equal(looked_up, whole.model.embed_tokens(ids))
    hidden = torch.randn(3, spec.hidden_size)
    logits = torch.cat([shard.lm_head(hidden) for shard in shards], dim=-1)
    assert torch.equal(logits[:, 509:], torch.zeros(3, 1))  # the padding row
    torch.testing.assert_close(logits[:, :509], whole.lm_head(hidden))


def assert_split_matches(whole: LLM, llm: LLM) -> None:
    """The split engine gives the whole model's greedy tokens, short and chunked prompts, and an abort
    mid-prompt leaves every rank without the sequence and no block in use."""
    expected = greedy_tokens(whole)
    try:
        assert greedy_tokens(llm) == expected
        assert greedy_tokens(llm, LONG_PROMPT) == greedy_tokens(whole, LONG_PROMPT)
        engine = llm.engine
        engine.add_request("aborted", list(range(3, 40)), GREEDY)
        engine.step()
        engine.abort_request("aborted")
        assert greedy_tokens(llm) == expected  # the ranks dropped the aborted sequence too
        assert engine.kv.num_used_blocks == 0
    finally:
        shut_down(llm)


@pytest.mark.parametrize("size", [2, 4])
def test_tiny_model_split_gives_the_same_greedy_tokens_and_leaks_no_block_on_abort(size):
    llm = tensor_parallel("dummy:tiny", size)
    assert executor_of(llm).info.all_reduce == "gloo"  # the custom all-reduce needs CUDA: its fallback
    assert_split_matches(LLM("dummy:tiny", **SETTINGS), llm)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_shards_hold_the_whole_models_codes(quantization):
    # int4 groups of 32: the tiny model's o_proj shard at TP=2 has 32 input columns
    settings = {"quantization": quantization, "quantization_group_size": 32 if quantization == "int4" else None}
    expected = greedy_tokens(LLM("dummy:tiny", **(SETTINGS | settings)))
    llm = tensor_parallel("dummy:tiny", 2, **settings)
    try:
        assert greedy_tokens(llm) == expected
    finally:
        shut_down(llm)


def test_fp8_shards_run_with_the_whole_models_weight_scales():
    """fp8 weight codes are the whole model's slice (row-parallel scales over every rank's columns), but
    each rank scales its own share of a row-parallel layer's activations, so the split model's greedy
    tokens are close to one process's, not necessarily identical (measured: all 3 prompts the same)."""
    expected = greedy_tokens(LLM("dummy:tiny", **(SETTINGS | {"quantization": "fp8"})))
    llm = tensor_parallel("dummy:tiny", 2, quantization="fp8")
    try:
        got = greedy_tokens(llm)
    finally:
        shut_down(llm)
    same = sum(a == b for a, b in zip(got, expected))
    assert same >= len(expected) - 1, (got, expected)


def test_int4_groups_must_not_straddle_a_shard():
    """The whole model's group size (64 for the tiny model) is the one each shard must hold whole."""
    model = build_empty_model(get_preset("tiny"), torch.float32, "cpu", TensorParallel(rank=0, size=2))
    with pytest.raises(InvalidRequestError, match="group size 64 does not divide o_proj .*tensor-parallel shard"):
        quantize_model(model, "int4", group_size=None)


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_embedded_model_split_three_ways_gives_the_same_greedy_tokens(quantization):
    """Float32, and the file's own Q4_1 / Q8_0 codes sliced per rank (o_proj and down_proj on whole
    blocks of 32 inputs)."""
    assert_embedded_split_matches(tensor_parallel("smollm2-135m", 3, quantization=quantization), quantization)


def assert_embedded_split_matches(llm: LLM, quantization: str) -> None:
    """The split engine's greedy tokens are one process's, at the same quantization; shuts it down."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = greedy_tokens(LLM("smollm2-135m", **(SETTINGS | {"quantization": quantization})), prompts)
    try:
        assert greedy_tokens(llm, prompts) == expected
    finally:
        shut_down(llm)


def test_embedded_model_refuses_two_ranks():
    with pytest.raises(InvalidRequestError, match="9 attention heads.*valid sizes: 1, 3"):
        tensor_parallel("smollm2-135m", 2)


def assert_a_dead_rank_1_ends_the_engine(llm: LLM) -> None:
    """Rank 0 waits on rank 1 (a tensor-parallel peer, or the next pipeline stage): once it dies the
    next step ends the engine with an error naming it, fast, not a hang."""
    try:
        greedy_tokens(llm)
        worker_processes(llm)[1].kill()
        worker_processes(llm)[1].join()
        t0 = time.perf_counter()
        with pytest.raises(EngineDeadError, match="rank 1 .* exited"):
            greedy_tokens(llm)
        assert time.perf_counter() - t0 < 60  # the liveness poll's seconds, not a collective's timeout
    finally:
        shut_down(llm)


def test_a_rank_that_dies_ends_the_engine_with_a_clear_error():
    assert_a_dead_rank_1_ends_the_engine(tensor_parallel("dummy:tiny", 2))


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"])
def test_ranks_started_apart_join_like_a_second_host(monkeypatch, layout):
    """The engine's "host" starts rank 0 only (LOCAL_WORLD_SIZE=1); rank 1 is `goodserve worker`
    with torchrun's variables, as on another host (the steps then go by gloo broadcasts: with
    pipeline micro-batches in flight too)."""
    expected = greedy_tokens(LLM("dummy:tiny", **SETTINGS))
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in (env | {"LOCAL_WORLD_SIZE": "1"}).items():
        monkeypatch.setenv(name, value)
    worker_env = os.environ | env | {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"}
    worker_env.pop("LOCAL_WORLD_SIZE")
    worker = subprocess.Popen([sys.executable, "-m", "goodserve", "worker"], env=worker_env)
    llm = None
    try:
        llm = LLM("dummy:tiny", **(SETTINGS | {layout: 2}))
        assert len(worker_processes(llm)) == 1
        assert greedy_tokens(llm) == expected
        assert greedy_tokens(llm, LONG_PROMPT) == greedy_tokens(LLM("dummy:tiny", **SETTINGS), LONG_PROMPT)
        worker.kill()
        worker.wait()
        with pytest.raises(EngineDeadError, match="tensor-parallel"):
            greedy_tokens(llm)
    finally:
        worker.kill()
        if llm is not None:
            shut_down(llm)
