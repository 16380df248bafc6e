"""An LLM's memory is given back: after shutdown() or the end of a `with` block the model's weights
and the KV cache are freed while the LLM object lives on, and an LLM merely dropped is freed before
the next engine loads, even where a reference cycle holds its engine (as the frames of a module
imported lazily during the build can: torch._dynamo's hold every caller's locals). The collector is
off in these tests, so only the engine's own collection can free a cycle."""

from __future__ import annotations

import gc
import weakref

import pytest

from goodserve import LLM, SamplingParams
from goodserve.errors import EngineDeadError
from helpers import runner_of

SETTINGS = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 16}
PROMPT = {"prompt_token_ids": [3, 4, 5, 6]}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def collector_off():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def used_llm() -> LLM:
    llm = LLM("dummy:tiny-moe", **SETTINGS)
    llm.generate(PROMPT, GREEDY)
    return llm


def held_memory(llm: LLM) -> list[weakref.ref]:
    """Weak references to a weight, the KV cache's tensors and the model, with a reference cycle
    that holds the engine (what a lazy import's frames do)."""
    runner = runner_of(llm)
    cycle = [llm.engine]
    cycle.append(cycle)
    tensors = [next(runner.model.parameters()), runner.kv_caches[0].k, runner.kv_caches[-1].v]
    return [weakref.ref(x) for x in (*tensors, runner.model, runner)]


def freed(refs: list[weakref.ref]) -> bool:
    return all(ref() is None for ref in refs)


def test_shutdown_frees_the_weights_and_kv_cache_while_the_llm_lives_on():
    llm = used_llm()
    refs = held_memory(llm)
    llm.shutdown()
    assert freed(refs)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(PROMPT, GREEDY)
    llm.shutdown()  # again: nothing left to do


def test_leaving_a_with_block_frees_them():
    with used_llm() as llm:
        refs = held_memory(llm)
        assert not freed(refs)
    assert freed(refs)


def test_a_dropped_llm_is_freed_before_the_next_engine_loads():
    llm = used_llm()
    refs = held_memory(llm)
    del llm
    assert not freed(refs)  # the cycle holds it: the collector is off
    with LLM("dummy:tiny", **SETTINGS):
        assert freed(refs)
