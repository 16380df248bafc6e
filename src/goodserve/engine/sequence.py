"""One generated sequence's state. A request with n > 1 owns n sequences that share its prompt."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from goodserve.outputs import LogprobsEntry, RequestMetrics
from goodserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    request_id: str
    index: int  # which of the request's n outputs this is
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    max_len: int  # prompt + allowed new tokens, capped by the context window
    arrival_time: float = field(default_factory=time.time)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, by content
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    generator: torch.Generator | None = None  # per-request seed: reproducible whatever the batch
    grammar: object | None = None  # its own grammar matcher (engine/grammar.py), advanced per token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobsEntry | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    pooled: torch.Tensor | None = None  # pooling: the sum of the hidden states pooled so far
    embedding: list[float] | None = None  # pooling: the result, once the prompt is computed
    metrics: RequestMetrics | None = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0

    def priority_key(self) -> tuple[int, float, str]:
        return (self.params.priority, self.arrival_time, self.seq_id)
