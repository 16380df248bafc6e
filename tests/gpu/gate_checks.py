"""What the gate compares and how: engines built the same way, greedy runs, and scored sequences.

A run's greedy tokens are scored by a reference (the plain-torch engine, or Hugging Face
transformers) teacher-forced on those tokens: each must be the reference's top choice, or within
a tolerance of it, so a near-tie that rounding flips passes and a wrong kernel does not. Prompt
logprobs (top 20 at every position of prompt + generated tokens) give the logit difference.
Both are measured relative to the reference's spread at that position (its best logprob minus its
20th best), so one tolerance fits a random tiny model's flat logits and a real model's peaked ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from goodserve import LLM, SamplingParams

TOP = 20  # prompt logprobs per position (the most SamplingParams allows)
GREEDY_TOKENS = 12
# Small pools and graph sets: every engine here builds quickly. 512 tokens a step holds a 300-row prefill.
ENGINE_DEFAULTS = dict(num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=512, seed=0)
MODES = {  # how the fast engine runs: CUDA graphs and async scheduling
    "graphs+async": dict(enforce_eager=False, async_scheduling=True),
    "graphs": dict(enforce_eager=False, async_scheduling=False),
    "eager": dict(enforce_eager=True, async_scheduling=False),
}
TORCH_PATH = dict(attention_backend="torch", enforce_eager=True, async_scheduling=False)


@dataclass(frozen=True)
class Tolerance:
    gap: float  # a generated token's largest relative gap below the reference's best
    logprob_diff: float  # the largest relative logprob difference, over 20 tokens at every position


def tolerance(dtype: str, kv_cache_dtype: str, quantization: str = "none") -> Tolerance:
    """Set from the embedded model on a CPU, one engine against another: bfloat16 against float32
    differed by 0.14 of the spread at most (greedy gaps 0.006), an fp8 KV cache by 0.23; an int4
    bfloat16 engine's decode kernel against its prefill path flipped a token 0.033 below the best;
    int4 weights against float32 ones (an error a broken kernel would exceed) differed by 1.3, with
    gaps of 1.1. fp8 activations round every linear layer's input to 3 mantissa bits, so the last-bit
    differences of two attention paths cross rounding steps of 6%: on an H100 the embedded model in
    bfloat16 with fp8 KV gave a gap of 0.16 and logprob differences of 0.31 (eager against torch)."""
    if quantization == "fp8":
        return Tolerance(0.3, 0.6)
    if dtype == "float32" and kv_cache_dtype == "auto":
        return Tolerance(1e-3, 1e-3)
    return Tolerance(0.15, 0.5) if kv_cache_dtype == "fp8" else Tolerance(0.1, 0.3)


def build(model: str, device: str, **options) -> LLM:
    return LLM(model, device=device, **{**ENGINE_DEFAULTS, **options})


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = GREEDY_TOKENS) -> list[list[int]]:
    outputs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [out.outputs[0].token_ids for out in outputs]


Entries = list[dict[int, float]]  # per position 1..L-1: token -> logprob (top 20 and the token fed)


def engine_scores(llm: LLM, sequences: list[list[int]]) -> list[Entries]:
    outputs = run(llm, sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP))
    return [[{t: lp.logprob for t, lp in entry.items()} for entry in out.prompt_logprobs[1:]] for out in outputs]


@torch.no_grad()
def hf_scores(model, sequences: list[list[int]]) -> list[Entries]:
    """The same entries from a transformers model's full distribution."""
    device = next(model.parameters()).device
    scores = []
    for ids in sequences:
        logprobs = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0, :-1].float(), -1)
        top = logprobs.topk(TOP, dim=-1).indices
        fed = torch.tensor(ids[1:], device=device).unsqueeze(-1)
        picked = torch.cat([top, fed], dim=-1)
        values = logprobs.gather(-1, picked)
        scores.append([dict(zip(t, v)) for t, v in zip(picked.tolist(), values.tolist())])
    return scores


@dataclass
class Comparison:
    max_gap: float  # the largest relative gap of a generated token under the reference
    max_logprob_diff: float  # the largest relative logprob difference, any position, any common token
    flips: int  # generated tokens that are not the reference's top choice

    def properties(self) -> list[tuple[str, float | int]]:
        return [("max_rel_gap", round(self.max_gap, 6)), ("max_rel_logprob_diff", round(self.max_logprob_diff, 6)),
                ("flips", self.flips)]


def compare(sequences: list[list[int]], prompt_lens: list[int], ours: list[Entries], ref: list[Entries]) -> Comparison:
    gaps, diffs, flips = [0.0], [0.0], 0
    for ids, prompt_len, our_entries, ref_entries in zip(sequences, prompt_lens, ours, ref):
        for position, (mine, theirs) in enumerate(zip(our_entries, ref_entries), start=1):
            ranked = sorted(theirs.values(), reverse=True)
            spread = max(ranked[0] - ranked[min(TOP, len(ranked)) - 1], 1e-6)
            diffs.append(max(abs(mine[t] - theirs[t]) for t in mine.keys() & theirs.keys()) / spread)
            if position >= prompt_len:  # a generated token: how far below the reference's best
                gap = (ranked[0] - theirs[ids[position]]) / spread
                gaps.append(gap)
                flips += gap > 0
    return Comparison(max(gaps), max(diffs), flips)


def leading_agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Fraction of generated tokens equal to the reference's own greedy run before the first difference."""
    agree = 0
    for a, b in zip(ours, ref):
        agree += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return agree / max(sum(len(a) for a in ours), 1)


def assert_within(comparison: Comparison, tol: Tolerance) -> None:
    assert comparison.max_gap <= tol.gap, f"a generated token is {comparison.max_gap:.3g} below the best ({tol})"
    assert comparison.max_logprob_diff <= tol.logprob_diff, \
        f"logprobs differ by {comparison.max_logprob_diff:.3g} of the spread ({tol})"


@torch.no_grad()
def hf_twin(model):
    """transformers' Llama holding `model`'s float weights (a dummy model has no file HF could read):
    checkpoint names are ours except for q/k/v and gate/up, which are row blocks of one matrix here."""
    import transformers

    from goodserve.model.hf_loader import _our_name
    from goodserve.model.llama import WeightFiller

    spec = model.spec
    assert spec.rope_scaling is None and not spec.attention_bias, "a plain Llama shape"
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tie_word_embeddings)
    twin = transformers.LlamaForCausalLM(config).to(device=next(model.parameters()).device, dtype=torch.float32)
    ours, shard_rows = dict(model.named_parameters()), WeightFiller(model).shard_rows
    state = {}
    for name in twin.state_dict():
        our_name, shard = _our_name(name)
        weight = ours[our_name]
        if shard is not None:
            start, rows = shard_rows[shard]
            weight = weight[start : start + rows]
        state[name] = weight.float()
    twin.load_state_dict(state)
    return twin.eval()
