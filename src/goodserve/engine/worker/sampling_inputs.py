"""Builds the sampler's per-row tensors for the rows that sample this step, from the runner's
request states and the scheduler's plain data.

Every tensor reaches the device through pinned memory, copied without waiting: a CUDA copy from
pageable memory synchronizes the stream. Under async scheduling the runner builds these right after
launching step N+1's forward, before the engine records step N, so such a copy would make the host
wait for that forward (sampling at temperature > 0 pipelines, as greedy does); and a step with
penalties or min_tokens would pay a synchronization per row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from goodserve.engine.worker.model_inputs import RequestState
from goodserve.ops.sampler import SamplingBatch
from goodserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    state: RequestState
    num_output_tokens: int
    output_token_ids: list[int] | None  # given where penalties count them

    @property
    def params(self) -> SamplingParams:
        return self.state.params


@dataclass
class GrammarBitmask:
    """The engine's grammar masks for a step (engine/frontend/grammar.py): rows of allowed-token bits on the
    host, and which sampled rows they belong to (None: every one)."""

    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32, pinned where a GPU reads it
    rows: list[int] | None


def build_sampling_batch(rows: list[SamplingRow], vocab_size: int, device: torch.device,
                         eos_token_ids: list[int], grammar: GrammarBitmask | None = None) -> SamplingBatch:
    batch = _settings(rows, vocab_size, device, eos_token_ids)
    if grammar is not None:
        batch.token_bitmask = grammar.bitmask.to(device, non_blocking=True)
        if grammar.rows is not None:
            batch.bitmask_rows = on_device(grammar.rows, torch.int64, device)
    return batch


def _settings(seqs: list[SamplingRow], vocab_size: int, device: torch.device, eos_token_ids: list[int]) -> SamplingBatch:
    params = [seq.state.params for seq in seqs]
    max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
    if all(seq.state.argmax_only for seq in seqs):  # the common fast path, its facts found once a request
        return SamplingBatch(all_greedy=True, max_logprobs=max_logprobs)
    plain = all(p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                for p in params)
    needs_ban = any(_bans_stop_tokens(seq) for seq in seqs)
    logit_bias = _logit_bias(params, device) if any(p.logit_bias for p in params) else None
    if plain and not needs_ban and all(p.greedy for p in params):  # argmax only (min_tokens already reached)
        return SamplingBatch(all_greedy=True, max_logprobs=max_logprobs, logit_bias=logit_bias)
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    temperature, top_p, min_p = on_device(
        [[0.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
        torch.float32, device)
    batch = SamplingBatch(
        temperature=temperature,
        top_k=on_device(top_k, torch.int64, device),
        top_p=top_p,
        min_p=min_p,
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
    return on_device([rows, tokens], torch.int64, device), on_device(values, torch.float32, device)


def _add_penalties(batch: SamplingBatch, seqs: list[SamplingRow], vocab_size: int, device) -> None:
    params = [seq.params for seq in seqs]
    batch.repetition_penalty, batch.presence_penalty, batch.frequency_penalty = on_device(
        [[p.repetition_penalty for p in params], [p.presence_penalty for p in params],
         [p.frequency_penalty for p in params]], torch.float32, device)
    batch.prompt_mask = _marked([seq.state.prompt_token_ids for seq in seqs], vocab_size, device)
    batch.output_counts = torch.zeros(len(seqs), vocab_size, device=device)
    index = _row_token_index([seq.output_token_ids or [] for seq in seqs], device)
    batch.output_counts.index_put_(index, torch.ones(len(index[1]), device=device), accumulate=True)


def _bans_stop_tokens(seq: SamplingRow) -> bool:
    """min_tokens not reached yet; a grammar's end outranks it (banning the only token its complete
    text allows would leave none)."""
    return seq.num_output_tokens < seq.params.min_tokens and seq.params.structured_outputs is None


def _banned_before_min_tokens(seqs: list[SamplingRow], vocab_size: int, device, eos_token_ids: list[int]):
    def stops(seq: SamplingRow) -> list[int]:
        if not _bans_stop_tokens(seq):
            return []
        return [t for t in [*seq.params.stop_token_ids, *([] if seq.params.ignore_eos else eos_token_ids)]
                if t < vocab_size]

    return _marked([stops(seq) for seq in seqs], vocab_size, device)


def _marked(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[N, V] bool: True at every row's tokens."""
    marked = torch.zeros(len(token_lists), vocab_size, dtype=torch.bool, device=device)
    index = _row_token_index(token_lists, device)
    return marked.index_put_(index, torch.ones(len(index[1]), dtype=torch.bool, device=device))


def _row_token_index(token_lists: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, token ids) on the device: the index of every row's tokens in an [N, V] tensor."""
    rows = [row for row, tokens in enumerate(token_lists) for _ in tokens]
    return tuple(on_device([rows, list(itertools.chain.from_iterable(token_lists))], torch.int64, device))


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a tensor on device, the host not waiting for the copy (pinned memory: the caching
    host allocator keeps the buffer until the copy is done)."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
