"""`goodserve serve --record-requests FILE`: one JSON line per prompt the server accepts, with its
arrival time, so `goodserve tune --workload FILE` (or `bench --dataset-name custom`) replays real
traffic: its mix of lengths, its repeats and, from the gaps between arrivals, its burstiness.

    {"arrival_s": 12.031, "prompt_sha256": "9f2c...", "prompt_tokens": 431, "output_tokens": 256}

--record-prompts hash (the default) keeps no text: a SHA-256 of the prompt's token ids, so repeats
stay visible; keep writes the prompt itself (as the model saw it: a chat request's rendered template).
output_tokens is the max_tokens the client asked for (absent where it set none).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from goodserve.sampling_params import SamplingParams

RECORD_PROMPTS = ("hash", "keep")


class RequestRecorder:
    def __init__(self, path: str, keep_prompts: bool, tokenizer):
        self.file = Path(path).open("a", encoding="utf-8", buffering=1)  # a line reaches the file as it is written
        self.keep_prompts, self.tokenizer = keep_prompts, tokenizer
        self.start = time.monotonic()

    def record(self, prompts: list[list[int]], params: SamplingParams) -> None:
        arrival = round(time.monotonic() - self.start, 4)
        for ids in prompts:
            row: dict = {"arrival_s": arrival, "prompt_tokens": len(ids)}
            if self.keep_prompts and self.tokenizer is not None:
                row["prompt"] = self.tokenizer.decode(ids, skip_special_tokens=False)
            else:
                row["prompt_sha256"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
            if params.max_tokens is not None:
                row["output_tokens"] = params.max_tokens
            self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()
