"""Per-request sampling settings, named and defaulted as in vLLM's SamplingParams.

Every field is checked at construction: its type (a bool is not a number), that floats are finite,
and a range that nothing downstream can overflow (the sampler builds int64 and float32 tensors from
them; seeds go to torch.Generator.manual_seed, which takes 64 bits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from goodserve.errors import InvalidRequestError
from goodserve.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
# Far past any useful setting (at temperature 100 every token is about equally likely), and float32 holds it.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300  # bounds the host work and the scatter each step pays per biased request
POOLING = ("last", "mean")
OUTPUT_KINDS = ("cumulative", "delta")
MAX_SLO_MS = 86_400_000.0  # a day
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, +100 makes it all but certain


@dataclass
class SamplingParams:
    n: int = 1  # the engine caps it (EngineConfig.max_n_per_request)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off; above the vocabulary size it keeps every token
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context window; 0: the prompt only (prefill_only)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # the engine checks them against the vocabulary
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k alternatives per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0  # lower is served first, as in vLLM
    # Latency targets (ms) the "slo" scheduler policy serves this request by (engine/core/slo_policy.py);
    # None: no target. The server fills in its --slo-ttft-ms / --slo-tpot-ms where a body sets none.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    structured_outputs: StructuredOutputsParams | None = None  # the output follows this grammar
    # token id -> added to its logit before penalties, temperature and top-k/p (the engine checks ids
    # against the vocabulary); logprobs stay those of the unbiased distribution
    logit_bias: dict[int, float] = field(default_factory=dict)
    # 'last' | 'mean': embed the prompt (its final hidden states pooled, L2-normalized) instead of
    # generating; needs max_tokens=0 and n=1
    pooling: str | None = None
    # What each of the request's outputs holds, as vLLM's RequestOutputKind: "cumulative" (everything
    # so far) or "delta" (what was added since the last output). A stream takes deltas: copying a
    # sequence's tokens into every step's output costs each step time in the length of its answers.
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        if type(self.top_k) is int and self.top_k == 0:  # (not False, not 0.0: those are refused)
            self.top_k = -1
        self.validate()

    @property
    def prefill_only(self) -> bool:
        """The request finishes once its prompt is computed: scoring (prompt logprobs) or embedding."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        _check_int("n", self.n, 1, INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, INT32_MAX, " (-1 or 0: off)")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 0, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        _check_int("priority", self.priority, INT64_MIN, INT64_MAX)
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) is not None:
                _check_float(name, getattr(self, name), 0.0, MAX_SLO_MS, low_open=True)
        for token in self.stop_token_ids:
            _check_int("stop_token_ids entries", token, 0, INT32_MAX)
        _check_logit_bias(self.logit_bias)
        if self.pooling is not None:
            if self.pooling not in POOLING:
                raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING)}, got {self.pooling!r}")
            if self.max_tokens != 0 or self.n != 1:
                raise InvalidRequestError("a pooling request generates nothing: it needs max_tokens=0 and n=1")
        if self.output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {getattr(self, name)!r}")


def _check_logit_bias(bias: dict) -> None:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    for token, value in bias.items():
        _check_int("logit_bias token ids", token, 0, INT32_MAX)
        _check_float(f"logit_bias[{token}]", value, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)


def _as_list(name: str, value) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _check_int(name: str, value, low: int, high: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be an integer in [{low}, {high}]{note}, got {value!r}")


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not low <= value <= high or (low_open and value == low):
        raise InvalidRequestError(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
