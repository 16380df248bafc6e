"""Pipeline parallelism on the CPU (gloo, one process per rank): the model cut into stages of
contiguous layers gives the greedy tokens of the whole one, alone and under tensor parallelism
(TP=2 x PP=2, four processes); a stage holds only its layers; sizes past the layer count are
refused clearly; aborts leak no block; a stage that dies ends the engine instead of hanging it."""

from __future__ import annotations

import pytest
import torch

from goodserve import LLM
from goodserve.errors import InvalidRequestError
from goodserve.model.llama import build_empty_model
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.presets import get_preset
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
        llm.engine.executor.shutdown()


def test_quantized_stages_give_the_same_greedy_tokens():
    """int8 computed at load, lm_head included: only the last stage has one to quantize."""
    settings = {"quantization": "int8", "quantize_lm_head": True}
    expected = greedy_tokens(LLM("dummy:tiny", **(SETTINGS | settings)))
    llm = parallel("dummy:tiny", 2, **settings)
    try:
        assert greedy_tokens(llm) == expected
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_embedded_model_in_two_stages_gives_the_same_greedy_tokens(quantization):
    """Float32, and the file's own Q4_1 / Q8_0 codes, each stage keeping its layers' only."""
    assert_embedded_split_matches(parallel("smollm2-135m", 2, quantization=quantization), quantization)


def test_a_last_stage_that_dies_ends_the_engine_with_a_clear_error():
    assert_a_dead_rank_1_ends_the_engine(parallel("dummy:tiny", 2))
