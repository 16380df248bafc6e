"""The grammar mask in the sampler, against a plain reference: a Python loop over the packed bits."""

import torch

from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.sampler import SamplingBatch, sample
from goodserve.ops.token_bitmask import apply_token_bitmask, unpack_bitmask

VOCAB = 100  # not a multiple of 32: the last word is partly padding


def reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    rows = [[bool((int(word) >> bit) & 1) for word in row for bit in range(32)][:vocab] for row in bitmask]
    return torch.tensor(rows)


def random_bitmask(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (rows, (VOCAB + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)


def test_unpack_matches_the_bit_loop_including_the_sign_bit():
    bitmask = random_bitmask(5, 0)
    bitmask[0, 0] = -2**31  # only bit 31 set
    assert torch.equal(unpack_bitmask(bitmask, VOCAB), reference_allowed(bitmask, VOCAB))


def test_tokens_past_a_narrower_mask_are_not_allowed():
    """A grammar's vocabulary (its tokenizer's) may be smaller than the model's logits."""
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)  # tokens 0..63 all allowed
    allowed = unpack_bitmask(bitmask, VOCAB)
    assert allowed.shape == (2, VOCAB) and allowed[:, :64].all() and not allowed[:, 64:].any()


def test_only_the_masked_rows_change():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    bitmask, rows = random_bitmask(2, 2), torch.tensor([1, 4])
    out = apply_token_bitmask(logits, bitmask, rows)
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        expected[row][~reference_allowed(bitmask, VOCAB)[i]] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.equal(apply_token_bitmask(logits[[1, 4]], bitmask, None), expected[[1, 4]])


def test_sampler_picks_allowed_tokens_and_leaves_free_rows_bitwise_unchanged():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=g)
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[0, 2] = 1 << 5  # row 1 may only say token 69
    bitmask[1, 0] = 0b1010  # row 3: tokens 1 or 3
    rows = torch.tensor([1, 3])
    for make in (lambda: SamplingBatch(all_greedy=True, max_logprobs=2),
                 lambda: SamplingBatch(temperature=torch.tensor([0.0, 1.0, 0.0, 1.0]), top_k=torch.full((4,), VOCAB),
                                       top_p=torch.ones(4), min_p=torch.zeros(4), generators=[None] * 4,
                                       needs_top_k_p=False, max_logprobs=2)):
        free = sample(logits, make(), TORCH_KERNELS)
        batch = make()
        batch.token_bitmask, batch.bitmask_rows = bitmask, rows
        torch.manual_seed(0)
        constrained = sample(logits, batch, TORCH_KERNELS, raw_argmax=logits.argmax(-1))
        assert constrained.token_ids[1] == 69 and int(constrained.token_ids[3]) in (1, 3)
        assert torch.equal(constrained.token_ids[[0, 2]], free.token_ids[[0, 2]])
        assert torch.equal(constrained.logprobs[[0, 2]], free.logprobs[[0, 2]])
        # logprobs of the masked distribution: the one allowed token of row 1 is certain
        assert constrained.logprobs[1, 0] == 0.0 and constrained.logprobs[1, 2] == -9999.0
