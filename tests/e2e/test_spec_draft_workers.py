"""A draft model in the workers (engine/worker/drafter.py) when they run in processes of their own:
one worker process (mp), tensor parallelism (TP=2: rank 0 drafts) and pipeline parallelism (PP=2:
the last stage, which samples, drafts). The greedy tokens are those of speculation off in the
engine's own process, drafts are proposed and kept (the draft is the target's own weights), and a
seeded sampled run, verified by the rejection rule with the distributions the drafter kept,
repeats itself."""

from __future__ import annotations

import pytest

from goodserve import LLM, SamplingParams
from helpers import shut_down
from test_tensor_parallel import fast_timeout  # noqa: F401 (a fixture its tests use)
from test_tensor_parallel import PROMPTS, SETTINGS, greedy_tokens

SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("layout", [{"executor_backend": "mp"}, {"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["mp", "tp2", "pp2"])
def test_a_draft_model_in_worker_processes_keeps_the_targets_tokens(layout):
    expected = greedy_tokens(LLM("dummy:tiny", **SETTINGS))
    llm = LLM("dummy:tiny", speculative_model="dummy:tiny", num_speculative_tokens=3, spec_policy="always",
              **SETTINGS, **layout)
    try:
        assert greedy_tokens(llm) == expected
        stats = llm.engine.stats()
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens // 2 > 0
        before = stats.spec_decode_num_draft_tokens
        assert _tokens(llm, SAMPLED) == _tokens(llm, SAMPLED)
        assert llm.engine.stats().spec_decode_num_draft_tokens > before
    finally:
        shut_down(llm)
