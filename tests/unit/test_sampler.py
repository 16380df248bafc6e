"""The sampler against a plain, row-by-row reference written from the definitions."""

import math

import pytest
import torch

from goodserve.engine.worker.model_inputs import RequestState
from goodserve.engine.worker.sampling_inputs import SamplingRow, build_sampling_batch
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.sampler import apply_penalties, gather_logprobs, sample, top_k_top_p_min_p
from goodserve.sampling_params import SamplingParams

VOCAB = 50


def seq_with(params: SamplingParams, prompt=(1, 2, 3), output=(), seed_index=0) -> SamplingRow:
    generator = torch.Generator().manual_seed(params.seed + seed_index) if params.seed is not None else None
    state = RequestState(f"s{id(params)}", params, list(prompt), False, generator)
    return SamplingRow(state, len(output), list(output))


def reference_allowed(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if top_k > 0:
        order = order[:top_k]
    z = sum(math.exp(scaled[i]) for i in order)
    probs = {i: math.exp(scaled[i]) / z for i in order}
    kept, mass = [], 0.0
    for i in order:  # smallest prefix whose mass reaches top_p
        kept.append(i)
        mass += probs[i]
        if mass >= top_p:
            break
    top = probs[order[0]]
    return {i for i in kept if probs[i] >= min_p * top}


@pytest.mark.parametrize("top_k,top_p,min_p", [(-1, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.7, 0.0),
                                               (-1, 1.0, 0.3), (10, 0.8, 0.05), (1, 0.5, 0.0)])
def test_top_k_top_p_min_p_keep_the_reference_set(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 2
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = build_sampling_batch([seq_with(params) for _ in range(3)], VOCAB, torch.device("cpu"), [0])
    masked = top_k_top_p_min_p(logits / 0.8, batch, TORCH_KERNELS)
    for row in range(3):
        got = set(torch.nonzero(torch.isfinite(masked[row])).flatten().tolist())
        assert got == reference_allowed(logits[row].tolist(), 0.8, top_k, top_p, min_p)


def test_penalties_match_the_definitions():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    prompt, output = (4, 5, 6), (6, 7, 7, 7)
    batch = build_sampling_batch([seq_with(params, prompt, output)], VOCAB, torch.device("cpu"), [0])
    got = apply_penalties(logits.clone(), batch)[0]
    expected = logits[0].clone()
    for token in set(prompt) | set(output):
        x = expected[token]
        expected[token] = x / 1.3 if x > 0 else x * 1.3
    for token in set(output):
        expected[token] -= 0.5 + 0.25 * output.count(token)
    torch.testing.assert_close(got, expected)


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 100.0  # token 9 is eos and by far the most likely
    early = seq_with(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[11]), output=(1,))
    done = seq_with(SamplingParams(temperature=0, min_tokens=1), output=(1,))
    batch = build_sampling_batch([early, done], VOCAB, torch.device("cpu"), [9])
    out = sample(logits, batch, TORCH_KERNELS)
    assert out.token_ids[0] != 9 and out.token_ids[1] == 9


def test_a_precomputed_argmax_stands_in_only_for_unchanged_logits():
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 100.0
    precomputed = torch.tensor([9, 9])
    plain = build_sampling_batch([seq_with(SamplingParams(temperature=0)) for _ in range(2)], VOCAB,
                                 torch.device("cpu"), [9])
    assert sample(logits, plain, TORCH_KERNELS, precomputed).token_ids is precomputed
    banned = build_sampling_batch([seq_with(SamplingParams(temperature=0, min_tokens=3), output=(1,))] * 2,
                                  VOCAB, torch.device("cpu"), [9])
    assert 9 not in sample(logits, banned, TORCH_KERNELS, precomputed).token_ids.tolist()  # eos banned: recomputed


def test_logit_bias_is_added_per_row_and_only_rows_with_one_pay():
    torch.manual_seed(5)
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=0, logit_bias={3: 5.0, 7: -100.0}), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, seed=1, logit_bias={11: 100.0}),
              SamplingParams(temperature=0, repetition_penalty=1.5, logit_bias={7: 2.5}, logprobs=2)]
    batch = build_sampling_batch([seq_with(p) for p in params], VOCAB, torch.device("cpu"), [0])
    expected = logits.clone()  # plain torch, row by row: bias first, then the penalty of the last row
    expected[0, 3] += 5.0
    expected[0, 7] -= 100.0
    expected[2, 11] += 100.0
    expected[3, 7] += 2.5
    for token in (1, 2, 3):
        x = expected[3, token]
        expected[3, token] = x / 1.5 if x > 0 else x * 1.5
    torch.testing.assert_close(apply_penalties(logits, batch), expected)
    out = sample(logits, batch, TORCH_KERNELS, raw_argmax=logits.argmax(-1))  # the raw argmax must not stand in
    assert out.token_ids.tolist()[:2] == expected[:2].argmax(-1).tolist()
    assert out.token_ids[2] == 11 and out.token_ids[3] == expected[3].argmax()
    torch.testing.assert_close(out.logprobs[3, 1:], logits[3].log_softmax(-1).topk(2).values)  # unbiased
    greedy = [SamplingParams(temperature=0, logit_bias={int(logits[0].argmax()): -100.0}),
              SamplingParams(temperature=0)]
    fast = build_sampling_batch([seq_with(p) for p in greedy], VOCAB, torch.device("cpu"), [0])
    out = sample(logits[:2], fast, TORCH_KERNELS, logits[:2].argmax(-1))
    assert fast.all_greedy and out.token_ids[0] != logits[0].argmax()
    plain = build_sampling_batch([seq_with(SamplingParams(temperature=0.5))], VOCAB, torch.device("cpu"), [0])
    assert plain.logit_bias is None


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=0, logprobs=3)
    batch = build_sampling_batch([seq_with(params) for _ in range(4)], VOCAB, torch.device("cpu"), [0])
    out = sample(logits, batch, TORCH_KERNELS)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    reference = torch.log_softmax(logits.double(), -1)
    for row in range(4):
        top = reference[row].topk(3)
        assert out.logprob_token_ids[row, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(out.logprobs[row, 1:].double(), top.values, rtol=1e-5, atol=1e-5)
        assert out.ranks[row] == 1
    values, ids, ranks = gather_logprobs(logits, torch.tensor([0, 1, 2, 3]), 0)
    for row in range(4):
        assert ranks[row] == 1 + int((reference[row] > reference[row, row]).sum())


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=42)

    def draw(batch_rows: int) -> list[int]:
        seqs = [seq_with(params)] + [seq_with(SamplingParams(temperature=1.0)) for _ in range(batch_rows - 1)]
        tokens = []
        for _ in range(20):
            batch = build_sampling_batch(seqs, VOCAB, torch.device("cpu"), [0])
            tokens.append(int(sample(logits.expand(batch_rows, -1).clone(), batch, TORCH_KERNELS).token_ids[0]))
        return tokens

    assert draw(1) == draw(5)
    assert len(set(draw(1))) > 1  # it does sample, not argmax


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    params = SamplingParams(temperature=1.0, seed=7)
    seq = seq_with(params)
    batch = build_sampling_batch([seq], VOCAB, torch.device("cpu"), [49])
    counts = torch.zeros(VOCAB)
    for _ in range(4000):
        counts[int(sample(logits, batch, TORCH_KERNELS).token_ids[0])] += 1
    expected = torch.softmax(logits[0], -1) * 4000
    assert torch.all((counts[:4] - expected[:4]).abs() < 5 * expected[:4].sqrt() + 5)


def test_penalties_and_bans_land_on_their_own_rows():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    rows = [seq_with(SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5), prompt=(1, 2), output=(3, 3)),
            seq_with(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]), prompt=(5,), output=()),
            seq_with(SamplingParams(presence_penalty=1.0), prompt=(6, 7, 8), output=(9,))]
    batch = build_sampling_batch(rows, VOCAB, torch.device("cpu"), [0])
    expected = logits.clone()
    for row, (prompt, output, rep, freq, pres) in enumerate([((1, 2), (3, 3), 1.5, 0.5, 0.0), ((5,), (), 1.0, 0.0, 0.0),
                                                             ((6, 7, 8), (9,), 1.0, 0.0, 1.0)]):
        for token in set(prompt) | set(output):
            x = expected[row, token]
            expected[row, token] = x / rep if x > 0 else x * rep
        for token in set(output):
            expected[row, token] -= pres + freq * output.count(token)
    expected[1, [0, 4]] = float("-inf")  # eos and the stop token, before min_tokens
    torch.testing.assert_close(apply_penalties(logits, batch), expected)
