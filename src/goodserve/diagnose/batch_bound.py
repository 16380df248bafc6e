"""The fastest a batch of requests sent at once can finish on a GPU, and what bounds it.

One token a step (no speculation): a request of o output tokens takes o forward passes, its prefill
(which samples its first token) and o - 1 decodes, so the batch takes at least max(o) steps, and
each step reads the weights once: all of them but the embedding table, of which a token reads one
row (left out); the lm_head in full; of a mixture of experts the experts the step's tokens are
routed to (the expected count under uniform routing, with every request started in the first step:
that count grows ever slower with the tokens, so crowding them into the fewest steps reads the
fewest). Each decoded token reads its sequence's K/V so far (its prompt and the tokens generated so
far, its own included; a sliding-window layer its window only), and every token fed writes its own.

FLOPs: 2 per matmul weight a token passes through (the lm_head's only where a token is sampled: a
prompt's last position and each decoded token; the last sampled token is never fed), and 4 x
q_size per (query, key) pair a layer attends (QK^T and PV; causal over a prompt).

Floor = max(bytes / bandwidth, FLOPs / matmul rate). It assumes compute and memory traffic overlap
perfectly and every other request packs into the longest one's steps, with every request's KV held
at once: a ceiling no engine reaches, which says which resource binds and how far a run is from it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from goodserve.diagnose.calc import decode_weight_bytes, dtype_bytes
from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec


@dataclass(frozen=True)
class BatchBound:
    requests: int
    prompt_tokens: int
    output_tokens: int
    steps: int  # the longest request's output tokens: forward passes nothing can shorten
    weight_bytes: float  # over all the steps
    kv_token_reads: float  # tokens of K/V the decodes read, all layers' (a windowed layer's count 1 / layers)
    kv_read_bytes: float
    kv_write_bytes: float
    kv_held_bytes: float  # every request's K/V at its end, all held at once (what the packing above needs)
    matmul_flops: float
    attention_flops: float
    bandwidth: float  # bytes/s
    flops_rate: float  # FLOP/s

    @property
    def weight_bytes_per_step(self) -> float:
        """A dense model's weights less the embedding table; a mixture of experts' mean over the steps."""
        return self.weight_bytes / self.steps

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    @property
    def bytes_seconds(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def flops_seconds(self) -> float:
        return self.flops / self.flops_rate

    @property
    def seconds(self) -> float:
        return max(self.bytes_seconds, self.flops_seconds)

    @property
    def binds(self) -> str:
        return "bandwidth" if self.bytes_seconds >= self.flops_seconds else "compute"

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        derived = ("weight_bytes_per_step", "bytes", "flops", "bytes_seconds", "flops_seconds", "seconds", "binds",
                   "requests_per_s", "output_tokens_per_s")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


def batch_bound(spec: ModelSpec, lengths: list[tuple[int, int]], bandwidth: float, flops_rate: float,
                dtype: str = "bf16", kv_dtype: str = "bf16") -> BatchBound:
    """lengths: (prompt tokens, output tokens) of each request; bandwidth in bytes/s, flops_rate in FLOP/s."""
    if not lengths:
        raise InvalidRequestError("a batch needs at least one request")
    if any(p < 1 or o < 1 for p, o in lengths):
        raise InvalidRequestError("every request needs at least one prompt token and one output token")
    if bandwidth <= 0 or flops_rate <= 0:
        raise InvalidRequestError("the bandwidth and the matmul rate must be positive")
    steps = max(o for _, o in lengths)
    fed = sum(p + o - 1 for p, o in lengths)
    sampled = sum(o for _, o in lengths)
    head = spec.vocab_size * spec.hidden_size
    weights = sum(decode_weight_bytes(spec, dtype, tokens) for tokens in _tokens_per_step(lengths, steps))
    # Every token fed attends over positions 1..p+o-1 of its sequence; the decodes (after the prompt) read them.
    attended = sum(_layer_positions(spec, 1, p + o - 1) for p, o in lengths)
    read = sum(_layer_positions(spec, p + 1, p + o - 1) for p, o in lengths)
    kv_per_token = spec.kv_bytes_per_token(dtype_bytes(kv_dtype))
    return BatchBound(
        requests=len(lengths), prompt_tokens=sum(p for p, _ in lengths), output_tokens=sampled, steps=steps,
        weight_bytes=weights,
        kv_token_reads=read / spec.num_layers, kv_read_bytes=read * kv_per_token / spec.num_layers,
        kv_write_bytes=fed * kv_per_token,
        kv_held_bytes=sum(spec.kv_bytes_per_sequence(p + o - 1, dtype_bytes(kv_dtype)) for p, o in lengths),
        matmul_flops=2.0 * (spec.num_matmul_params() - head) * fed + 2.0 * head * sampled,
        attention_flops=4.0 * spec.q_size * attended, bandwidth=bandwidth, flops_rate=flops_rate)


def _tokens_per_step(lengths: list[tuple[int, int]], steps: int) -> list[int]:
    """Tokens each step feeds with every request started at once: the prompts in the first, then a token of
    each request still generating."""
    ending = Counter(o for _, o in lengths)
    tokens, running = [sum(p for p, _ in lengths)], len(lengths)
    for step in range(2, steps + 1):
        running -= ending[step - 1]
        tokens.append(running)
    return tokens


def _layer_positions(spec: ModelSpec, first: int, last: int) -> int:
    """(query, key) pairs of one head summed over the layers, for the queries at positions first..last
    (1-based): a query at position c sees c keys, min(c, window) in a sliding-window layer."""
    windows = spec.layer_windows or (None,) * spec.num_layers
    return sum(_sum_of_min(first, last, w) for w in windows)


def _sum_of_min(first: int, last: int, window: int | None) -> int:
    """sum of min(c, window) for c in first..last."""
    if last < first:
        return 0
    if window is None or last <= window:
        return (first + last) * (last - first + 1) // 2
    if first > window:
        return window * (last - first + 1)
    return _sum_of_min(first, window, None) + window * (last - window)
