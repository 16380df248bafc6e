"""One generated sequence's state on the engine side. A request with n > 1 owns n sequences that
share its prompt. The scheduler writes its progress (status, computed tokens, the tokens it
appends, how it finished); what callers read of it (text, logprobs) is the request's output state
(engine/frontend/request.SampleOutput); the runner never sees it (it gets plain data:
engine/seam/scheduler_output.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from goodserve.outputs import RequestMetrics
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
    grammar: object | None = None  # its own grammar matcher (engine/frontend/grammar.py), advanced per token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    # moving average of its judged drafts' outcomes (spec_decode/policy.py); unmeasured: even odds,
    # enough to try drafting in a small batch
    spec_acceptance: float = 0.5

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

    @property
    def counts_output_tokens(self) -> bool:
        """Whether its sampling reads its generated tokens (penalties count them)."""
        p = self.params
        return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)

    @property
    def samples_on_device(self) -> bool:
        """Whether its next tokens need no host data from the step before: no penalties, no min_tokens
        ban pending, no logprobs, no stop strings (they need the text), and that it samples at all
        (prefill-only requests finish on the host). A grammar's mask needs the previous token, but
        only once the forward runs (the engine waits for it then)."""
        p = self.params
        return (not p.prefill_only and p.logprobs is None and p.prompt_logprobs is None and not p.stop
                and not self.counts_output_tokens and self.num_output_tokens >= p.min_tokens)

    def ends_with_next_token(self) -> bool:
        """Whether the token being sampled for it (not yet appended) is certainly its last, by length."""
        limit = self.params.max_tokens or self.max_len
        return self.num_output_tokens + 1 >= limit or self.num_tokens + 1 >= self.max_len

    def priority_key(self) -> tuple[int, float, str]:
        return (self.params.priority, self.arrival_time, self.seq_id)
