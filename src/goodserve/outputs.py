"""What a finished (or streaming) request hands back, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> (logprob, rank); the sampled token is always present.
LogprobsEntry = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[LogprobsEntry] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life; server and bench read these."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request (it finishes as "abort")
    embedding: list[float] | None = None  # a pooling request's (SamplingParams.pooling), once finished
