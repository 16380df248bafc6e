"""The result JSON: run settings, metrics (vLLM's key names), and every request's record."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from goodserve.bench.records import RequestRecord
from goodserve.errors import InvalidRequestError


# The per-request arrays `vllm bench serve` keeps in its result file only with --save-detailed.
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def build_result(settings: dict, metrics: dict, records: list[RequestRecord]) -> dict:
    """One run, in the keys `vllm bench serve` writes: its settings, metrics and per-request arrays,
    one entry per request sent (a failed one: zero lengths and times, its error; a success: error
    ""), then goodserve's own (SLO attainment, cost, "records": every request's full record, which
    the HTML report and `goodserve diagnose` read)."""
    start = min((r.send_time for r in records), default=0.0)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        **settings,
        "request_goodput": None,  # (vLLM's key without --goodput targets; metrics set it with them)
        **metrics,
        **peak_output_rate(records, start),
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len if r.success else 0 for r in records],
        "ttfts": [r.ttft or 0.0 for r in records],
        "itls": [r.itls for r in records],
        "latencies": [r.e2e or 0.0 for r in records],
        "start_times": [r.send_time - start for r in records],
        "generated_texts": [r.generated_text if r.success else "" for r in records],
        "errors": [r.error if not r.success else "" for r in records],
        "records": [r.to_dict() for r in records],
    }


def peak_output_rate(records: list[RequestRecord], start: float) -> dict:
    """vLLM's max_output_tokens_per_s (the most tokens streamed in any one second of the run, a
    chunk's tokens spread evenly over its request's chunks) and max_concurrent_requests (requests
    in flight during that second)."""
    counts: dict[int, float] = {}
    for r in records:
        if r.success and r.chunk_times:
            for t in r.chunk_times:
                second = int(t - start)
                counts[second] = counts.get(second, 0.0) + r.output_len / len(r.chunk_times)
    if not counts:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    second = max(counts, key=counts.get)
    begin, end = start + second, start + second + 1
    in_flight = sum(1 for r in records if r.send_time < end and (r.end_time or r.send_time) >= begin)
    return {"max_output_tokens_per_s": counts[second], "max_concurrent_requests": in_flight}


def without_details(result: dict) -> dict:
    """A result as `vllm bench serve --save-result` writes it without --save-detailed."""
    if "sweep" in result:
        return {**result, "sweep": [without_details(run) for run in result["sweep"]]}
    return {k: v for k, v in result.items() if k not in DETAILED_KEYS}


def records_of(result: dict) -> list[RequestRecord]:
    return [RequestRecord.from_dict(row) for row in result.get("records", [])]


def runs_of(result: dict) -> list[dict]:
    """The runs in a result file: a sweep's runs, or the single run itself."""
    return result.get("sweep") or [result]


def _json_safe(value):
    # JSON has no inf; vLLM writes request_rate inf as the string "inf".
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def save_json(result: dict, path: Path, append: bool = False) -> None:
    """append: one more line of JSON after what the file holds (vLLM's --append-result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not append:
        path.write_text(json.dumps(_json_safe(result), indent=2))
        return
    with open(path, "a+") as out:
        out.write(("\n" if out.tell() else "") + json.dumps(_json_safe(result)))


def load_json(path: str | Path) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InvalidRequestError(f"result file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{path} is not a bench result (invalid JSON: {exc.msg})") from None
    if not isinstance(result, dict) or not ("completed" in result or "sweep" in result):
        raise InvalidRequestError(f"{path} is not a bench result (no 'completed' or 'sweep' key)")
    return result
