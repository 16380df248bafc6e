"""One request as the load generator saw it: when it was sent, when each chunk came back, what failed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """Times are seconds on the benchmark's monotonic clock (0 = start of the timed run)."""

    index: int
    prompt_len: int  # input tokens: the server's usage when it reports one, else the workload's count
    expected_output_len: int  # what was asked for (max_tokens)
    send_time: float
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # every content chunk, first one included
    end_time: float | None = None
    output_len: int = 0  # generated tokens: usage.completion_tokens, else the tokenizer, else chunks
    output_len_source: str = "none"  # "usage" | "tokenizer" | "chunks" | "engine"
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    success: bool = False
    error: str = ""
    generated_text: str = ""
    conversation_id: int | None = None  # multi-turn: which conversation the turn belongs to
    # The in-process target only: TTFT and TPOT as the engine's own token times put them (its clock),
    # beside the client's, which also count the wait for the client's turn to read each token.
    engine_ttft: float | None = None
    engine_tpot: float | None = None

    @property
    def ttft(self) -> float | None:
        if not self.success or self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        if not self.success or self.end_time is None:
            return None
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Decode time per token after the first; undefined for outputs of fewer than two tokens."""
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_len < 2:
            return None
        return (e2e - ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks; a chunk carrying several tokens counts as one gap."""
        if not self.success:
            return []
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_dict(self) -> dict:
        row = asdict(self)
        row.update(ttft=self.ttft, tpot=self.tpot, e2el=self.e2e, itl=self.itls)
        return row

    @classmethod
    def from_dict(cls, row: dict) -> "RequestRecord":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in row.items() if k in names})
