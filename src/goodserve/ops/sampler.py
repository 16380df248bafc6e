"""Turns a batch of next-token logits into tokens: penalties, temperature, top-k/top-p/min-p, draws.

Every row is handled as in the reference semantics of vLLM / OpenAI:
- logit_bias (OpenAI): a per-request value added to chosen tokens' logits, first (as vLLM v1);
- repetition_penalty (HF/CTRL style) over prompt and output tokens: positive logits divided by it,
  negative ones multiplied;
- presence / frequency penalties (OpenAI) over output tokens: logit -= presence * [count > 0]
  + frequency * count;
- min_tokens: stop tokens masked until that many tokens are out;
- temperature, then top-k, then top-p (smallest set whose mass reaches p), then min-p (drop tokens
  under min_p * the top probability); a tie at a set's edge keeps every token of that logit;
- greedy rows take the argmax of the penalized logits.
Draws use the exponential-race trick (argmax p / E, E ~ Exp(1)), with noise from the row's own
generator when the request has a seed, so a seeded request samples the same tokens in any batch.
A row with a grammar (engine/frontend/grammar.py) has every token its grammar refuses at -inf first
(ops/token_bitmask.py), so greedy, sampled and logprobs all see the constrained distribution.
Logprobs are those of the model's distribution before bias, penalties and temperature (after the
grammar mask: a refused token has logprob -inf, reported as -9999.0 as vLLM does, since JSON has no -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.token_bitmask import apply_token_bitmask


@dataclass
class SamplingBatch:
    """Per-row sampling settings, as tensors on the logits' device (built by the engine)."""

    # Per-row settings; None on the all-greedy fast path, which needs none of them.
    temperature: torch.Tensor | None = None  # [N] float32; 0 marks greedy
    top_k: torch.Tensor | None = None  # [N] int64; vocab size when off
    top_p: torch.Tensor | None = None  # [N] float32
    min_p: torch.Tensor | None = None  # [N] float32
    generators: list[torch.Generator | None] | None = None
    # Penalties: None when no row in the batch uses any.
    repetition_penalty: torch.Tensor | None = None  # [N]
    presence_penalty: torch.Tensor | None = None  # [N]
    frequency_penalty: torch.Tensor | None = None  # [N]
    prompt_mask: torch.Tensor | None = None  # [N, V] bool: token appears in the prompt
    output_counts: torch.Tensor | None = None  # [N, V] float32: times each token was generated
    banned: torch.Tensor | None = None  # [N, V] bool: stop tokens before min_tokens is reached
    # Sparse: ([2, M] int64 (row, token id), [M] float32 bias); None when no row has a logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    needs_top_k_p: bool = True
    all_greedy: bool = False
    max_logprobs: int = -1  # most top alternatives any row asked for; -1: none asked
    # Grammars: None when no row in the batch has one (engine/frontend/grammar.py fills it).
    token_bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32, one row per constrained row
    bitmask_rows: torch.Tensor | None = None  # [R] their rows in the batch; None: every row

    @property
    def changes_logits(self) -> bool:
        """Whether bias, penalties, bans or a grammar apply, so the greedy token may differ from the raw argmax."""
        return (self.repetition_penalty is not None or self.presence_penalty is not None or self.banned is not None
                or self.token_bitmask is not None or self.logit_bias is not None)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N, 1 + K]: sampled token's, then the top K
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + K]
    ranks: torch.Tensor | None = None  # [N]: rank of the sampled token (1 = most likely)
    # [N, V]: the distributions the sampled rows drew from (after penalties, temperature, top-k/p);
    # None when every row is greedy. Speculative decoding's rejection rule reads them.
    probs: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.logit_bias is not None:  # out of place: the raw logits still give the logprobs
        index, values = batch.logit_bias
        logits = logits.index_put((index[0], index[1]), values, accumulate=True)
    if batch.repetition_penalty is not None:
        seen = batch.prompt_mask | (batch.output_counts > 0)
        penalty = batch.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.presence_penalty is not None:
        counts = batch.output_counts
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    if batch.banned is not None:
        logits = logits.masked_fill(batch.banned, float("-inf"))
    return logits


# The sort-free kernel gives each row one program, which streams the row from one SM; the sort spreads
# a few rows over the whole card. benchmarks/gpu_sampling_filter.py times both at 1, 32 and 256 rows.
TRITON_FILTER_MIN_ROWS = 32


def top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch, kernels: KernelChoice) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k / top-p / min-p set. Each filter keeps a
    prefix of the row sorted by logit, so the set is every token at or above one threshold logit
    (ties at it all kept): found without a sort by the Triton kernel at many rows, from a sort here."""
    if kernels.triton and logits.shape[0] >= TRITON_FILTER_MIN_ROWS:
        from goodserve.ops.triton_top_k_top_p import triton_top_k_top_p_min_p

        return triton_top_k_top_p_min_p(logits, batch.top_k, batch.top_p, batch.min_p)
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    # Top-k keeps every token tied with the k-th logit (as Hugging Face's and vLLM's do); top-p's share
    # is of that set's mass.
    kth = sorted_logits.gather(1, batch.top_k.clamp(1, logits.shape[-1]).unsqueeze(1) - 1)
    drop = sorted_logits < kth
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token if the mass strictly before it is under top_p: the top token always survives.
    # top_p 1 is off, whatever the sum's rounding.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= batch.top_p.unsqueeze(1)) & (batch.top_p.unsqueeze(1) < 1)
    drop |= (sorted_logits - sorted_logits[:, :1]).exp() < batch.min_p.unsqueeze(1)  # p < min_p * p_top
    drop[:, 0] = False
    threshold = sorted_logits.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)  # the least kept
    return logits.masked_fill(logits < threshold, float("-inf"))


def exponential_noise(shape: torch.Size, generators: list[torch.Generator | None], device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


def argmax(x: torch.Tensor, kernels: KernelChoice) -> torch.Tensor:
    """[N, V] -> [N] int64: each row's first maximum, as torch.argmax (a many-program kernel on GPUs)."""
    if kernels.triton:
        from goodserve.ops.triton_ops import triton_argmax

        return triton_argmax(x, kernels.pdl)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch, kernels: KernelChoice,
           raw_argmax: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [N, V] float32, one row per sequence that samples this step; kernels: the model's.

    raw_argmax: argmax(logits) if already computed (the decode graph computes it); it stands in for
    the greedy tokens whenever no penalty changes the logits.
    """
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.token_bitmask, batch.bitmask_rows)
    raw_logits = logits
    logits = apply_penalties(logits, batch)
    use_raw = raw_argmax is not None and not batch.changes_logits
    greedy_tokens = raw_argmax if use_raw else argmax(logits, kernels)
    probs = None
    if batch.all_greedy:
        token_ids = greedy_tokens
    else:
        scaled = logits / batch.temperature.clamp(min=1e-5).unsqueeze(1)
        if batch.needs_top_k_p:
            scaled = top_k_top_p_min_p(scaled, batch, kernels)
        probs = scaled.softmax(dim=-1)
        noise = exponential_noise(probs.shape, batch.generators, probs.device)
        sampled = argmax(probs / noise, kernels)
        token_ids = torch.where(batch.temperature == 0, greedy_tokens, sampled)
    if batch.max_logprobs < 0:
        return SamplerOutput(token_ids=token_ids, probs=probs)
    return SamplerOutput(token_ids, *gather_logprobs(raw_logits, token_ids, batch.max_logprobs), probs=probs)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """Logprob and rank of token_ids under softmax(logits), with the num_top most likely tokens."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (chosen[:, :0], token_ids[:, None][:, :0])
    values = torch.cat([chosen, top_values], dim=1).clamp(min=-9999.0)  # a grammar's -inf: finite in JSON
    ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
    return values, ids, ranks
