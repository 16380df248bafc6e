"""The engine core's seams: the scheduler's output is plain data (it pickles and names no live
object), the runner behind the executor gives the same tokens whether its worker lives in the
engine's process or in one of its own, and the caller's configuration is resolved into a new one."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from goodserve import LLM, SamplingParams
from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine import Engine
from goodserve.engine.worker.executor import MultiprocExecutor
from goodserve.engine.seam.scheduler_output import NewRequestData, SchedulerOutput
from goodserve.structured_outputs import StructuredOutputsParams
from helpers import executor_of, shut_down

PLAIN = (str, int, float, bool, type(None))
PLAIN_RECORDS = (SchedulerOutput, NewRequestData, SamplingParams, StructuredOutputsParams)


def not_plain(value, path: str = "out") -> list[str]:
    """Where value holds anything but plain values, containers of them, and records of them."""
    if isinstance(value, PLAIN):
        return []
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in not_plain(v, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in not_plain(k, path) + not_plain(v, f"{path}[{k!r}]")]
    if type(value) in PLAIN_RECORDS:
        return [p for f in dataclasses.fields(value) for p in not_plain(getattr(value, f.name), f"{path}.{f.name}")]
    return [f"{path}: {type(value).__name__}"]


def test_scheduler_output_is_plain_data_that_pickles():
    engine = Engine(EngineConfig(model="dummy:tiny", num_kv_blocks=32, max_num_batched_tokens=8))
    engine.add_request("a", list(range(3, 14)), SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.2))
    engine.add_request("b", [5, 6], SamplingParams(temperature=0.7, seed=1, max_tokens=3, n=2))
    seen = []
    real = executor_of(engine).execute_model

    def execute_model(out):
        seen.append(pickle.loads(pickle.dumps(out)))
        assert seen[-1] == out
        assert not_plain(out) == []
        return real(out)

    executor_of(engine).execute_model = execute_model
    while engine.has_unfinished():
        engine.step()
    assert len(seen) >= 3 and seen[0].new_requests and seen[0].num_new_tokens == [8]  # a chunk of "a"
    assert any(out.penalty_token_ids for out in seen)  # "a"'s penalties count its own tokens
    assert any(out.finished_seq_ids for out in seen)


def test_a_worker_in_its_own_process_gives_the_same_tokens():
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30, 2)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, n=2)]
    settings = {"num_kv_blocks": 32, "max_num_batched_tokens": 16}
    expected = LLM("dummy:tiny", **settings).generate(prompts, params)
    llm = LLM("dummy:tiny", executor_backend="mp", **settings)
    try:
        assert isinstance(executor_of(llm), MultiprocExecutor)
        got = llm.generate(prompts, params)
    finally:
        shut_down(llm)
    for ours, ref in zip(got, expected):
        assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in ref.outputs]
        assert ours.outputs[0].logprobs == ref.outputs[0].logprobs
    assert got[2].prompt_logprobs == expected[2].prompt_logprobs
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.slow  # two worker processes; the fast tier meets the worker process in the test above
def test_a_worker_process_reports_its_request_errors_and_load_errors():
    llm = LLM("dummy:tiny", executor_backend="mp", num_kv_blocks=16)
    try:
        llm.engine.add_request("bad", [3, 4], SamplingParams(max_tokens=2))
        executor_of(llm).execute_model = _raising  # the engine isolates the request, the worker lives on
        outputs = llm.engine.step()
        assert outputs[0].error and "refused" in outputs[0].error
    finally:
        shut_down(llm)
    with pytest.raises(Exception, match="no-such-preset"):
        LLM("dummy:no-such-preset", executor_backend="mp")


def _raising(out) -> None:
    raise RuntimeError("refused")


def test_the_callers_config_is_resolved_into_a_new_frozen_one():
    config = EngineConfig(model="dummy:tiny", num_kv_blocks=16, enable_chunked_prefill=False, max_model_len=100)
    engine = Engine(config)
    assert config.dtype == "auto" and config.device == "auto" and config.max_num_batched_tokens == 2048
    resolved = engine.config
    assert (resolved.device, resolved.dtype, resolved.attention_backend) == ("cpu", "float32", "torch")
    assert resolved.num_kv_blocks == 16 and resolved.max_model_len == 100
    assert resolved.async_scheduling is False  # no CUDA graphs on the CPU
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.max_num_seqs = 1
