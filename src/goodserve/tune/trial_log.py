"""The trial log: one JSON line per measured configuration, written as each trial ends, so an
interrupted tune resumes from it (the search replays its decisions, measuring only what the log
lacks). Its first line holds the settings the trials were measured under: a log written for
another model, workload or SLO is refused rather than mixed in."""

from __future__ import annotations

import json
from pathlib import Path

from goodserve.errors import InvalidRequestError


class TrialLog:
    def __init__(self, path: Path, settings: dict):
        self.path = path
        self.trials: dict[str, dict] = {}
        if path.is_file() and path.stat().st_size:
            self._load(settings)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"settings": settings}) + "\n")

    def _load(self, settings: dict) -> None:
        lines = [line for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = [self._parse(line, number, number == len(lines)) for number, line in enumerate(lines, start=1)]
        if not any(rows[1:]):  # no trial yet (a run stopped before its first): nothing to protect
            self.path.write_text(json.dumps({"settings": settings}) + "\n")
            return
        if (rows[0] or {}).get("settings") != settings:
            raise InvalidRequestError(
                f"{self.path} holds trials measured under other settings (model, workload, SLOs, quality budget, "
                f"prompts): give another --output-dir, or remove the file to start over")
        self.trials = {row["key"]: row["trial"] for row in rows[1:] if row}

    def _parse(self, line: str, number: int, last: bool) -> dict | None:
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            if last:  # a line cut short by an interruption: the only damage a crash can do
                return None
            raise InvalidRequestError(f"{self.path}:{number}: not a trial log line (invalid JSON)") from None

    def get(self, key: str) -> dict | None:
        trial = self.trials.get(key)
        return None if trial is None else dict(trial)

    def append(self, key: str, trial: dict) -> None:
        self.trials[key] = dict(trial)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "trial": trial}) + "\n")
