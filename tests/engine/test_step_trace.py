"""--step-trace (engine/core/step_trace.py) on dummy:tiny: a line per step whose shapes add up to what the
requests asked for, counted by hand, and that diagnose reads; the same from an engine in its own process."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from goodserve import LLM, SamplingParams
from goodserve.config import EngineConfig
from goodserve.diagnose.steps import analyze_steps
from goodserve.engine.frontend.engine_process import EngineProcess
from goodserve.engine.core.step_trace import read_step_trace

PROMPTS = [[1, 2, 3, 4], [9, 8, 7], list(range(100, 120))]
MAX_TOKENS = 5
FIELDS = {"t", "decode_rows", "prompt_tokens", "context_tokens", "predicted_s", "measured_s", "graph", "ran_ahead",
          "running", "waiting", "prefill_cap", "targeted_decode_rows"}


def decode_context(prompt_len: int) -> int:
    """The K/V a request's decode rows read: its first token comes from its prompt's step, then each
    decode row reads what was computed before it and its own token."""
    return sum(prompt_len + i for i in range(1, MAX_TOKENS))


def check_trace(steps: list[dict], targeted_prompts: list[list[int]]) -> None:
    assert steps and all(set(step) == FIELDS for step in steps)
    assert sum(step["prompt_tokens"] for step in steps) == sum(map(len, PROMPTS))
    assert sum(step["decode_rows"] for step in steps) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert sum(step["context_tokens"] for step in steps) == sum(decode_context(len(p)) for p in PROMPTS)
    assert sum(step["targeted_decode_rows"] for step in steps) == len(targeted_prompts) * (MAX_TOKENS - 1)
    assert all(step["measured_s"] > 0 for step in steps)
    assert [step["t"] for step in steps] == sorted(step["t"] for step in steps)


def test_a_line_per_step_adding_up_to_the_requests(tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = LLM("dummy:tiny", num_kv_blocks=64, scheduler_policy="slo", step_trace=str(path))
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    targeted = replace(plain, slo_ttft_ms=10_000, slo_tpot_ms=10_000)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [targeted, plain, plain])
    steps = read_step_trace(str(path))
    assert len(steps) == llm.engine.stats().num_steps
    check_trace(steps, PROMPTS[:1])
    assert all(step["prefill_cap"] is not None for step in steps)  # the slo policy's
    middle = steps[len(steps) // 2]["t"]
    assert read_step_trace(str(path), since=middle) == [s for s in steps if s["t"] >= middle]
    assert read_step_trace(str(path), until=middle) == [s for s in steps if s["t"] < middle]
    assert analyze_steps(str(path), 50.0).steps == len(steps)  # what `goodserve diagnose --step-trace` reads


@pytest.mark.slow  # an engine process; the fast tier checks the trace of an engine in this process
def test_an_engine_in_its_own_process_writes_its_trace(tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = EngineProcess(EngineConfig(model="dummy:tiny", num_kv_blocks=64, step_trace=str(path)))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run() -> None:
        await engine.start()
        try:
            for i, prompt in enumerate(PROMPTS):
                async for _ in engine.generate(f"r{i}", prompt, params):
                    pass
        finally:
            await engine.shutdown(5.0)

    asyncio.run(run())
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    check_trace(steps, [])
    assert all(step["prefill_cap"] is None for step in steps)  # FCFS has none
