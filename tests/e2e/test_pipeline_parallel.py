"""Pipeline parallelism on the CPU (gloo, one process per rank): the model cut into stages of
contiguous layers gives the greedy tokens of the whole one, alone and under tensor parallelism
(TP=2 x PP=2, four processes); a stage holds only its layers; sizes past the layer count are
refused clearly; aborts leak no block; a stage that dies ends the engine instead of hanging it.
Micro-batches: the engine keeps a step in each stage, over sequences no other step holds, with one
process's tokens under arrivals, stops, aborts in flight and a request whose step fails."""

from __future__ import annotations

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.errors import InvalidRequestError
from goodserve.model.llama import build_empty_model
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.presets import get_preset
from helpers import shut_down
from test_async_scheduling import check_blocks, drive, summary
from test_async_scheduling_mp import traffic
from test_async_scheduling_mp import workers_with_graphs  # noqa: F401 (a fixture its tests use)
from test_tensor_parallel import fast_timeout  # noqa: F401 (a fixture its tests use)
from test_tensor_parallel import (LONG_PROMPT, SETTINGS, assert_a_dead_rank_1_ends_the_engine,
                                  assert_embedded_split_matches, assert_split_matches, greedy_tokens)


def parallel(model: str, pp: int, tp: int = 1, **settings) -> LLM:
    return LLM(model, pipeline_parallel_size=pp, tensor_parallel_size=tp, **(SETTINGS | settings))


def test_stages_hold_contiguous_layer_ranges_and_only_their_own_parts():
    spec = get_preset("smollm2-135m")  # 30 layers
    stages = [PipelineParallel(stage, 4) for stage in range(4)]
    assert [pp.layers(30) for pp in stages] == [range(0, 7), range(7, 15), range(15, 22), range(22, 30)]
    first, middle, last = (build_empty_model(spec, torch.float32, "meta", pp=stages[i]) for i in (0, 1, 3))
    layer_names = {name.split(".")[2] for model in (first, middle, last) for name, _ in model.named_parameters()
                   if name.startswith("model.layers.")}
    assert layer_names == {str(i) for i in (*range(0, 15), *range(22, 30))}
    assert first.model.embed_tokens is not None and first.lm_head is None and first.model.norm is None
    assert middle.model.embed_tokens is None and middle.lm_head is None
    assert last.lm_head.weight is last.model.embed_tokens.weight  # tied: the last stage's lm_head is the table


def test_micro_batches_are_on_by_default_on_the_cpu_and_can_be_turned_off():
    """On CUDA the stages run eagerly: a step's host time, not its rows, bounds it there."""
    from goodserve.config import EngineConfig
    from goodserve.engine.setup.config_resolution import resolve_for_device

    assert resolve_for_device(EngineConfig(device="cpu")).pipeline_micro_batches is True
    assert resolve_for_device(EngineConfig(device="cpu", pipeline_micro_batches=False)).pipeline_micro_batches is False


def test_more_stages_than_layers_are_refused():
    with pytest.raises(InvalidRequestError, match="pipeline-parallel-size 3 .* at least one of its 2 layers"):
        parallel("dummy:tiny", 3)
    with pytest.raises(InvalidRequestError, match="pipeline_parallel_size must be at least 1"):
        parallel("dummy:tiny", 0)


@pytest.mark.parametrize("model", ["dummy:tiny", "dummy:tiny-qwen"])  # lm_head apart from / tied to the embedding
def test_tiny_model_in_two_stages_gives_the_same_greedy_tokens_and_leaks_no_block_on_abort(model):
    assert_split_matches(LLM(model, **SETTINGS), parallel(model, 2))


def test_tensor_and_pipeline_parallel_together_give_the_same_greedy_tokens():
    """Four ranks: two stages, each a tensor-parallel group of two."""
    expected = greedy_tokens(LLM("dummy:tiny", **SETTINGS))
    llm = parallel("dummy:tiny", 2, tp=2)
    try:
        assert greedy_tokens(llm) == expected
        assert greedy_tokens(llm, LONG_PROMPT) == greedy_tokens(LLM("dummy:tiny", **SETTINGS), LONG_PROMPT)
    finally:
        shut_down(llm)


def test_quantized_stages_give_the_same_greedy_tokens():
    """int8 computed at load, lm_head included: only the last stage has one to quantize."""
    settings = {"quantization": "int8", "quantize_lm_head": True}
    expected = greedy_tokens(LLM("dummy:tiny", **(SETTINGS | settings)))
    llm = parallel("dummy:tiny", 2, **settings)
    try:
        assert greedy_tokens(llm) == expected
    finally:
        shut_down(llm)


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_embedded_model_in_two_stages_gives_the_same_greedy_tokens(quantization):
    """Float32, and the file's own Q4_1 / Q8_0 codes, each stage keeping its layers' only."""
    assert_embedded_split_matches(parallel("smollm2-135m", 2, quantization=quantization), quantization)


def test_a_last_stage_that_dies_ends_the_engine_with_a_clear_error():
    assert_a_dead_rank_1_ends_the_engine(parallel("dummy:tiny", 2))


@pytest.mark.parametrize("model, stages, micro_batches", [("dummy:tiny", 2, True), ("smollm2-135m", 3, True),
                                                         ("dummy:tiny", 2, False)])
def test_micro_batches_keep_the_stages_busy_with_one_process_tokens(model, stages, micro_batches):
    """Arrivals while others decode, a stop token, prompts in chunks: the same outputs as one
    process, most steps launched while the stages hold others (none with micro-batches off), no
    block leaked."""
    whole = LLM(model, **SETTINGS).engine
    stop_token = summary(drive(whole, traffic(None)))["r0"][0][0][6]
    reference = summary(drive(whole, traffic(stop_token)))
    llm = parallel(model, stages, pipeline_micro_batches=micro_batches)
    try:
        engine = llm.engine
        assert engine.micro_batches == micro_batches  # what engine_config_info reports
        assert summary(drive(engine, traffic(stop_token), check=True)) == reference
        pipelined, steps = engine.steps.num_pipelined_steps, engine.steps.num_steps
        assert pipelined >= steps // 2 if micro_batches else pipelined == 0
    finally:
        shut_down(llm)


def test_aborts_of_sequences_in_flight_in_the_stages_free_their_blocks():
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    requests = [(f"a{i}", list(range(3 + i, 12 + 2 * i)), params) for i in range(4)]
    reference = summary(drive(LLM("dummy:tiny", **SETTINGS).engine, {0: requests}))
    llm = parallel("dummy:tiny", 2)
    try:
        engine = llm.engine
        for rid, prompt, p in requests:
            engine.add_request(rid, prompt, p)
        aborted = {}
        while engine.has_unfinished():
            in_flight = {seq.request_id for step in engine._stages for seq in step.seqs}
            if engine.steps.num_steps >= 6 and not aborted and "a1" in in_flight:
                aborted["a1"] = engine.abort_request("a1")
                check_blocks(engine)
            engine.step(finished_only=True)
            check_blocks(engine)
        assert engine.kv.num_used_blocks == 0 and set(aborted) == {"a1"}
        tokens = aborted["a1"].outputs[0].token_ids
        assert 0 < len(tokens) < len(reference["a1"][0][0]) and tokens == reference["a1"][0][0][: len(tokens)]
        # the stages dropped the aborted sequence too: the same requests again give the same tokens
        assert summary(drive(engine, {0: requests})) == reference
    finally:
        shut_down(llm)


def test_a_request_whose_micro_batch_fails_fails_alone(workers_with_graphs):
    """The culprit arrives while the stages hold the others' steps: its step fails on every stage,
    the steps in flight still finish, and only the culprit gets the error."""
    poison = 2  # in no prompt here, nor in what the others generate (checked below)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    innocents = [(f"r{i}", list(range(3 + i, 10 + i)), params) for i in range(3)]
    expected = summary(drive(LLM("dummy:tiny", **SETTINGS).engine, {0: innocents}))
    assert all(poison not in tokens for (tokens, *_), in expected.values())
    engine = workers_with_graphs("dummy:tiny", poison=poison, graphs=False, pipeline_parallel_size=2).engine
    final = drive(engine, {0: innocents, 5: [("culprit", [5, poison, 6], params)]}, check=True)
    assert engine.steps.num_pipelined_steps > 0
    assert "poisoned forward" in final["culprit"].error
    assert {rid: v for rid, v in summary(final).items() if rid != "culprit"} == expected
