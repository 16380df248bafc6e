"""A scheduled step flattened to token-level lists (engine/worker/model_inputs.flatten), against lists
worked out by hand from the layout's definition."""

from goodserve.engine.worker.model_inputs import RequestState, flatten
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.spec_decode.acceptance import kept_tokens
from goodserve.sampling_params import SamplingParams

BLOCK = 16


def state(seq_id: str, prompt_len: int, wants_prompt_logprobs: bool = False, pooling: str | None = None):
    params = SamplingParams(temperature=0, pooling=pooling, max_tokens=0 if pooling else 16)
    return RequestState(seq_id, params, list(range(prompt_len)), wants_prompt_logprobs, None)


def test_a_mixed_step_flattens_row_by_row():
    """An ahead decode, a decode verifying two drafts across a block boundary, a prompt chunk that
    wants prompt logits, and a whole prompt pooled at its last token (neither of those samples)."""
    out = SchedulerOutput(
        seq_ids=["ahead", "verify", "chunk", "pooled"], num_new_tokens=[1, 3, 4, 3],
        num_computed_tokens=[20, 30, 4, 0], token_ids=[[], [7, 8, 9], [21, 22, 23, 24], [31, 32, 33]],
        block_tables=[[5, 9], [1, 2, 3], [6], [11]], samples=[True, True, False, False],
        num_output_tokens=[3, 5, 0, 0], draft_token_ids={1: [8, 9]}, num_ahead=1)
    requests = {s.seq_id: s for s in (state("ahead", 10), state("verify", 20), state("chunk", 10, True),
                                       state("pooled", 3, pooling="last"))}
    flat = flatten(out, requests, BLOCK)
    assert flat.input_ids == [0, 7, 8, 9, 21, 22, 23, 24, 31, 32, 33]  # the ahead row's token comes later
    assert flat.positions == [20, 30, 31, 32, 4, 5, 6, 7, 0, 1, 2]
    # block table entry (position // 16) * 16 + position % 16
    assert flat.slots == [9 * 16 + 4, 2 * 16 + 14, 2 * 16 + 15, 3 * 16, 96 + 4, 96 + 5, 96 + 6, 96 + 7, 176, 177, 178]
    assert flat.query_lens == [1, 3, 4, 3] and flat.seq_lens == [21, 33, 8, 3]
    assert flat.block_tables == out.block_tables
    assert flat.sample_rows == [0, 1]
    assert flat.logits_indices == [0, 1, 2, 3]  # the ahead row's one, the verifying row's last three
    # the chunk's tokens 4..7 predict prompt tokens 5..8; the pooled row's last token is flat row 10
    assert flat.prompt_logit_spans == {2: (4, 8)} and flat.pooling_spans == {3: (10, 11)}


def test_a_decode_step_takes_each_rows_next_slot():
    out = SchedulerOutput(seq_ids=["a", "b"], num_new_tokens=[1, 1], num_computed_tokens=[15, 16],
                          token_ids=[[4], [5]], block_tables=[[3], [8, 2]], samples=[True, True],
                          num_output_tokens=[1, 1])
    flat = flatten(out, {"a": state("a", 4), "b": state("b", 4)}, BLOCK)
    assert flat.input_ids == [4, 5] and flat.positions == [15, 16]
    assert flat.slots == [3 * 16 + 15, 2 * 16] and flat.seq_lens == [16, 17]
    assert flat.sample_rows == [0, 1] and flat.logits_indices == [0, 1]
    assert flat.prompt_logit_spans == {} and flat.pooling_spans == {}


def test_rows_without_drafts_keep_their_one_sample():
    assert kept_tokens([4, 7, 9], [[], [], []]) == [[4], [7], [9]]
    assert kept_tokens([4, 7, 9, 2, 6], [[], [7, 5], []]) == [[4], [7, 9], [6]]


def test_a_long_prompt_chunk_takes_the_slots_of_its_blocks():
    """38 tokens from position 10: the rest of block 4, all of blocks 7 and 2."""
    out = SchedulerOutput(seq_ids=["a", "b"], num_new_tokens=[1, 38], num_computed_tokens=[3, 10],
                          token_ids=[[1], list(range(38))], block_tables=[[9], [4, 7, 2]], samples=[True, True],
                          num_output_tokens=[2, 0])
    flat = flatten(out, {"a": state("a", 2), "b": state("b", 60)}, BLOCK)
    assert flat.positions == [3, *range(10, 48)]
    assert flat.slots == [9 * 16 + 3, *range(4 * 16 + 10, 5 * 16), *range(7 * 16, 8 * 16), *range(2 * 16, 3 * 16)]
    assert flat.logits_indices == [0, 38]
