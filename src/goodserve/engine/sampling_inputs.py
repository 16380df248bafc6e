"""Builds the sampler's per-row tensors for the rows that sample this step, from the runner's
request states and the scheduler's plain data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from goodserve.engine.model_inputs import RequestState
from goodserve.ops.sampler import SamplingBatch
from goodserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    state: RequestState
    num_output_tokens: int
    output_token_ids: list[int] | None  # given where penalties count them

    @property
    def params(self) -> SamplingParams:
        return self.state.params


@dataclass
class GrammarBitmask:
    """The engine's grammar masks for a step (engine/grammar.py): rows of allowed-token bits on the
    host, and which sampled rows they belong to (None: every one)."""

    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32, pinned where a GPU reads it
    rows: list[int] | None


def build_sampling_batch(rows: list[SamplingRow], vocab_size: int, device: torch.device,
                         eos_token_ids: list[int], grammar: GrammarBitmask | None = None) -> SamplingBatch:
    batch = _settings(rows, vocab_size, device, eos_token_ids)
    if grammar is not None:
        batch.token_bitmask = grammar.bitmask.to(device, non_blocking=True)
        if grammar.rows is not None:
            batch.bitmask_rows = torch.tensor(grammar.rows, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return batch


def _settings(seqs: list[SamplingRow], vocab_size: int, device: torch.device, eos_token_ids: list[int]) -> SamplingBatch:
    params = [seq.params for seq in seqs]
    max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
    plain = all(p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                for p in params)
    needs_ban = any(_bans_stop_tokens(seq) for seq in seqs)
    logit_bias = _logit_bias(params, device) if any(p.logit_bias for p in params) else None
    if plain and not needs_ban and all(p.greedy for p in params):  # the common fast path: argmax only
        return SamplingBatch(all_greedy=True, max_logprobs=max_logprobs, logit_bias=logit_bias)
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    batch = SamplingBatch(
        temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor([p.top_p for p in params], device=device),
        min_p=torch.tensor([p.min_p for p in params], device=device),
        generators=[seq.state.generator for seq in seqs],
        needs_top_k_p=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params if not p.greedy),
        all_greedy=all(p.greedy for p in params),
        max_logprobs=max_logprobs,
        logit_bias=logit_bias,
    )
    if not plain:
        _add_penalties(batch, seqs, vocab_size, device)
    if needs_ban:
        batch.banned = _banned_before_min_tokens(seqs, vocab_size, device, eos_token_ids)
    return batch


def _logit_bias(params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's bias as one sparse list: (row, token id) pairs and their values."""
    entries = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias.items()]
    rows, tokens, values = zip(*entries)
    return (torch.tensor([rows, tokens], dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _add_penalties(batch: SamplingBatch, seqs: list[SamplingRow], vocab_size: int, device) -> None:
    params = [seq.params for seq in seqs]
    batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
    batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
    batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)
    batch.prompt_mask = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
    batch.output_counts = torch.zeros(len(seqs), vocab_size, device=device)
    for row, seq in enumerate(seqs):
        prompt = torch.tensor(seq.state.prompt_token_ids, device=device)
        batch.prompt_mask[row, prompt] = True
        output = torch.tensor(seq.output_token_ids or [], dtype=torch.int64, device=device)
        batch.output_counts[row].index_add_(0, output, torch.ones(len(output), device=device))


def _bans_stop_tokens(seq: SamplingRow) -> bool:
    """min_tokens not reached yet; a grammar's end outranks it (banning the only token its complete
    text allows would leave none)."""
    return seq.num_output_tokens < seq.params.min_tokens and seq.params.structured_outputs is None


def _banned_before_min_tokens(seqs: list[SamplingRow], vocab_size: int, device, eos_token_ids: list[int]):
    banned = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
    for row, seq in enumerate(seqs):
        if _bans_stop_tokens(seq):
            stops = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else eos_token_ids)
            banned[row, [t for t in stops if t < vocab_size]] = True
    return banned
