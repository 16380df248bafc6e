"""The embedded model (fp32) against Hugging Face transformers loading the same GGUF file.

Ours runs over a paged KV cache built by hand (blocks out of order), prefill then decode steps, so
the comparison covers the cache write/read path, rotary positions and the GGUF q/k un-permutation.
"""

from __future__ import annotations

import pytest
import torch

from goodserve.model.llama import LlamaForCausalLM
from goodserve.model.loader import LoadedModel, load_model
from goodserve.ops.attention import AttentionMetadata, LayerKVCache

pytest.importorskip("transformers")


class PagedSequence:
    """One sequence run through our model over a small paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 8, block_size: int = 16):
        spec = model.spec
        self.model, self.block_size, self.length = model, block_size, 0
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.caches = [LayerKVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
        # Blocks deliberately out of order, so a wrong block-table lookup shows up.
        self.block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).int()

    @torch.no_grad()
    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed the next tokens; return their logits [len(token_ids), vocab]."""
        num_new, start = len(token_ids), self.length
        self.length += num_new
        positions = torch.arange(start, self.length)
        slots = self.block_table[positions // self.block_size].long() * self.block_size + positions % self.block_size
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
            seq_lens=torch.tensor([self.length], dtype=torch.int32),
            block_tables=self.block_table.unsqueeze(0),
            max_query_len=num_new, max_seq_len=self.length,
            query_lens_host=[num_new], seq_lens_host=[self.length],
        )
        hidden = self.model(torch.tensor(token_ids), positions, self.caches, meta)
        return self.model.compute_logits(hidden)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref.float(), rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    seq = PagedSequence(model)
    next_id = int(seq.step(prompt)[-1].argmax())
    out = [next_id]
    while len(out) < max_new_tokens and next_id not in eos_ids:
        next_id = int(seq.step([next_id])[-1].argmax())
        out.append(next_id)
    return out


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model("smollm2-135m", torch.float32, "cpu")


@pytest.fixture(scope="module")
def hf_model(hf_embedded):
    return hf_embedded


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969, 3 astronauts flew 384,400 km to the Moon. 🚀",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_and_decode_logits_match_hf(ours: LoadedModel, hf_model, prompt: str):
    ids = ours.tokenizer.encode(prompt)
    seq = PagedSequence(ours.model)
    prefill = seq.step(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert_logits_close(prefill, ref)
    # Decode steps: each new token attends the cached prompt plus the earlier decoded tokens.
    for _ in range(3):
        ids.append(int(ref[-1].argmax()))
        decoded = seq.step(ids[-1:])
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        assert_logits_close(decoded[0], ref[-1])


@pytest.mark.parametrize(
    ("prompt", "chat"), [(PROMPTS[0], False), (PROMPTS[2], False), (PROMPTS[1], True)], ids=["raw", "raw-digits", "chat"]
)
def test_greedy_continuation_matches_hf(ours: LoadedModel, hf_model, prompt: str, chat: bool):
    tokenizer = ours.tokenizer
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt)
    ours_greedy = greedy(ours.model, ids, 32, tokenizer.eos_token_ids)
    # HF's greedy choice after every prefix of our continuation, in one forward pass: if each equals
    # our next token, HF's own greedy loop produces exactly our 32 tokens (by induction on the step).
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + ours_greedy])).logits[0]
    hf_choices = logits[len(ids) - 1 : -1].argmax(-1).tolist()
    assert ours_greedy == hf_choices
    assert len(ours_greedy) >= 16  # a continuation long enough to mean something


def test_embedded_spec_matches_hf_config(ours: LoadedModel, hf_model):
    config = hf_model.config
    spec = ours.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
        config.num_key_value_heads, config.vocab_size,
    )
    assert spec.tie_word_embeddings and ours.model.lm_head.weight is ours.model.model.embed_tokens.weight
