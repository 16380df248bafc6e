"""The result JSON: run settings, metrics (vLLM's key names), and every request's record."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from goodserve.bench.records import RequestRecord
from goodserve.errors import InvalidRequestError


def build_result(settings: dict, metrics: dict, records: list[RequestRecord]) -> dict:
    """One run. Per-request arrays are the ones `vllm bench serve --save-result` writes."""
    ok = [r for r in records if r.success]
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        **settings,
        **metrics,
        "input_lens": [r.prompt_len for r in ok],
        "output_lens": [r.output_len for r in ok],
        "ttfts": [r.ttft for r in ok],
        "itls": [r.itls for r in ok],
        "generated_texts": [r.generated_text for r in ok],
        "errors": [r.error for r in records if not r.success],
        "records": [r.to_dict() for r in records],
    }


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


def save_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(result), indent=2))


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
