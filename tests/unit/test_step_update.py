"""The scheduler's half of a step's way back (Scheduler.update_from_output): a row's kept tokens are
appended up to the first that ends the sequence (a stop token once min_tokens are out, its length),
the rest are dropped, and what it appended and finished comes back as data."""

from __future__ import annotations

import pytest

from goodserve.config import EngineConfig
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.seam.runner_output import ModelRunnerOutput
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.core.sequence import Sequence
from goodserve.sampling_params import SamplingParams

EOS = 2


def _first_step(params: SamplingParams):
    """A scheduler holding one sequence, and its first step (the whole prompt, its last row sampling)."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    scheduler = Scheduler(config, KVCacheManager(num_blocks=16, block_size=4), eos_token_ids=[EOS])
    seq = Sequence("r#0", "r", 0, [5, 6, 7], 3, params, max_len=64)
    scheduler.add(seq)
    return scheduler, seq, scheduler.schedule()


def _kept(tokens: list[int]) -> ModelRunnerOutput:
    """Row 0 keeps these tokens (as a row verifying drafts keeps the confirmed ones and one more)."""
    return ModelRunnerOutput(sample_rows=[0], token_ids=[tokens])


@pytest.mark.parametrize("params, row, num_appended, reason, stop_reason", [
    (SamplingParams(max_tokens=10), [9, EOS, 4, 11], 2, "stop", None),
    (SamplingParams(max_tokens=10, stop_token_ids=[4]), [9, 4, EOS], 2, "stop", 4),
    (SamplingParams(max_tokens=2), [9, 4, 11], 2, "length", None),
    (SamplingParams(max_tokens=10, min_tokens=3), [9, EOS, 4, EOS], 4, "stop", None),  # the first eos is too early
    (SamplingParams(max_tokens=10, ignore_eos=True), [9, EOS, 4, 11], 4, None, None),
])
def test_a_row_ends_at_the_first_token_that_ends_it(params, row, num_appended, reason, stop_reason):
    scheduler, seq, out = _first_step(params)
    update = scheduler.update_from_output(out, _kept(row))
    assert seq.output_token_ids == row[:num_appended]
    assert update.appended == [(0, seq, num_appended)]
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    assert update.finished == ([seq] if reason else []) and scheduler.has_unfinished() == (reason is None)
    assert seq.num_computed_tokens == (3 if reason is None else 0)  # the prompt's K/V; a finished one holds none


def test_a_sequence_that_finished_meanwhile_gets_nothing():
    """An abort while its step ran: the step's tokens for it are dropped."""
    scheduler, seq, out = _first_step(SamplingParams(max_tokens=10))
    scheduler.finish(seq, "abort")
    update = scheduler.update_from_output(out, _kept([9]))
    assert seq.output_token_ids == [] and update.appended == [] and update.finished == []
