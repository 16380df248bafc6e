"""Workloads: what each benchmark request asks (prompt, its token length, how many tokens to generate).

- random: synthetic prompts with lengths from a distribution (fixed, uniform, normal, lognormal)
  and an optional prefix shared by every request.
- sharegpt: the first human/assistant exchange of each ShareGPT conversation in a file; with no
  file, a synthetic length profile shaped like ShareGPT (long-tailed, lognormal).
- prefix_repetition: K system prompts of P tokens, each request one of them plus a unique suffix.
- multiturn: chat conversations whose history grows; turn t+1 is sent after turn t's answer.
- copy: "repeat this passage" prompts whose answer copies spans of the input (prompt lookup).
- custom: a JSONL file, one {"prompt": ..., "output_tokens": ...} object per line; a recording of
  serve's (--record-requests) with hashed prompts gives {"prompt_sha256": ..., "prompt_tokens": N}.
- sonnet: vLLM's: "pick as many lines as you can" over poem lines, a shared prefix of lines then
  random ones (the bundled sonnets, or a --dataset-path text file).
- hf: a Hugging Face dataset's rows from a local JSON / JSONL file (no hub here): ShareGPT-style
  conversations, or a prompt / instruction / question / problem / text field per row.
"""

from __future__ import annotations

from collections.abc import Iterator

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from goodserve.bench.text import PromptText
from goodserve.errors import InvalidRequestError

DATASETS = ("random", "sharegpt", "prefix_repetition", "multiturn", "copy", "custom", "sonnet", "hf")
LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal")


class DatasetError(InvalidRequestError):
    """A dataset file that is missing or malformed; the message names the file and line."""


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    conversation_id: int | None = None
    turn: int = 0
    # Multi-turn: earlier turns, filled in by the runner with the server's real answers.
    history: list[dict] = field(default_factory=list)

    def chat_messages(self) -> list[dict]:
        return [*self.history, {"role": "user", "content": self.prompt}]

    def completion_prompt(self) -> str:
        if not self.history:
            return self.prompt
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in self.chat_messages()]
        return "\n".join(lines) + "\nAssistant:"


@dataclass
class WorkloadConfig:
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    random_length_dist: str = "uniform"
    sharegpt_output_len: int | None = None
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    multiturn_num_turns: int = 4
    custom_output_len: int = 256
    sonnet_input_len: int = 550
    sonnet_output_len: int = 150
    sonnet_prefix_len: int = 200
    hf_output_len: int | None = None


def sample_lengths(rng: np.random.Generator, mean: int, ratio: float, dist: str, n: int) -> list[int]:
    """n lengths >= 1 centred on `mean`; `ratio` sets the spread (uniform: +-ratio*mean,
    normal: std = ratio*mean, lognormal: sigma = ratio around a median of `mean`)."""
    if dist not in LENGTH_DISTS:
        raise InvalidRequestError(f"unknown length distribution {dist!r}; choose from {LENGTH_DISTS}")
    if ratio < 0:
        raise InvalidRequestError(f"--random-range-ratio must not be negative, got {ratio}")
    if dist == "fixed" or ratio == 0:
        values = np.full(n, mean, dtype=np.float64)
    elif dist == "uniform":
        if not 0 <= ratio < 1:
            raise InvalidRequestError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        values = rng.integers(int(mean * (1 - ratio)), int(mean * (1 + ratio)) + 1, size=n)
    elif dist == "normal":
        values = rng.normal(mean, ratio * mean, size=n)
    else:
        values = rng.lognormal(np.log(mean), ratio, size=n)
    return np.maximum(1, np.rint(values)).astype(int).tolist()


def build_workload(cfg: WorkloadConfig, text: PromptText) -> list[BenchRequest]:
    if cfg.num_prompts < 1:
        raise InvalidRequestError(f"--num-prompts must be at least 1, got {cfg.num_prompts}")
    builders = {
        "random": _random, "sharegpt": _sharegpt, "prefix_repetition": _prefix_repetition,
        "multiturn": _multiturn, "copy": _copy, "custom": _custom, "sonnet": _sonnet, "hf": _hf,
    }
    if cfg.dataset_name not in builders:
        raise InvalidRequestError(f"unknown --dataset-name {cfg.dataset_name!r}; choose from {DATASETS}")
    return builders[cfg.dataset_name](cfg, text, np.random.default_rng(cfg.seed))


SYNTHETIC_DATASETS = ("random", "sharegpt")


def synthetic_lengths(cfg: WorkloadConfig) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request of a dataset whose lengths are drawn, not read
    from a file: the same draws, from the same seed, as build_workload's."""
    if cfg.dataset_name not in SYNTHETIC_DATASETS or cfg.dataset_path:
        raise InvalidRequestError(f"only {SYNTHETIC_DATASETS} without a dataset file draw their lengths")
    if cfg.num_prompts < 1:
        raise InvalidRequestError(f"--num-prompts must be at least 1, got {cfg.num_prompts}")
    rng = np.random.default_rng(cfg.seed)
    if cfg.dataset_name == "sharegpt":
        return _sharegpt_lengths(cfg, rng)
    return [(cfg.random_prefix_len + i, o) for i, o in _random_lengths(cfg, rng)]


def _random_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(input tokens after the shared prefix, output tokens) of each request."""
    n = cfg.num_prompts
    input_lens = sample_lengths(rng, cfg.random_input_len, cfg.random_range_ratio, cfg.random_length_dist, n)
    output_lens = sample_lengths(rng, cfg.random_output_len, cfg.random_range_ratio, cfg.random_length_dist, n)
    return list(zip(input_lens, output_lens))


def _random(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    lengths = _random_lengths(cfg, rng)
    prefix = text.make(cfg.random_prefix_len)
    requests = []
    for input_len, output_len in lengths:
        prompt = (prefix + " " + text.make(input_len)) if prefix else text.make(input_len)
        requests.append(BenchRequest(prompt, cfg.random_prefix_len + input_len, output_len))
    return requests


# ShareGPT-like profile: lognormal fits to ShareGPT V3 first exchanges (median prompt ~100 tokens,
# median answer ~200, both long-tailed), clipped to the filter vLLM applies to the real file.
_SHAREGPT_INPUT = (100, 1.1)
_SHAREGPT_OUTPUT = (200, 0.9)
_SHAREGPT_MIN, _SHAREGPT_MAX_PROMPT, _SHAREGPT_MAX_TOTAL = 4, 1024, 2048


def _sharegpt(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    if cfg.dataset_path:
        return _sharegpt_file(cfg, text, rng)
    return [BenchRequest(text.make(i), i, o) for i, o in _sharegpt_lengths(cfg, rng)]


def _sharegpt_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> list[tuple[int, int]]:
    n = cfg.num_prompts
    inputs = sample_lengths(rng, _SHAREGPT_INPUT[0], _SHAREGPT_INPUT[1], "lognormal", n)
    outputs = sample_lengths(rng, _SHAREGPT_OUTPUT[0], _SHAREGPT_OUTPUT[1], "lognormal", n)
    lengths = []
    for i, o in zip(inputs, outputs):
        i = int(np.clip(i, _SHAREGPT_MIN, _SHAREGPT_MAX_PROMPT))
        o = int(np.clip(o, _SHAREGPT_MIN, _SHAREGPT_MAX_TOTAL - i))
        lengths.append((i, cfg.sharegpt_output_len or o))
    return lengths


def offline_sharegpt_lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """The engine benchmarks' offline batch (benchmarks/gpu_engine.py): input and output lengths drawn
    lognormal (sigma 0.9) and rescaled until, clipped to 4..1024, their means are 200 and 180."""
    rng = np.random.default_rng(seed)

    def lognormal(mean: float, sigma: float) -> np.ndarray:
        draws = rng.lognormal(0.0, sigma, n)
        clipped = lambda scale: np.clip(draws * scale, 4, 1024)  # noqa: E731
        scale = mean / draws.mean()
        for _ in range(20):  # clipping the long tail lowers the mean: rescale until it is `mean`
            scale *= mean / clipped(scale).mean()
        return clipped(scale).astype(int)

    return lognormal(200, 0.9).tolist(), lognormal(180, 0.9).tolist()


def _sharegpt_file(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    path = Path(cfg.dataset_path)
    data = _read_json(path)
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    return _sharegpt_rows(data, path, cfg, text, rng)


def _sharegpt_rows(data: list, path: Path, cfg: WorkloadConfig, text: PromptText,
                   rng: np.random.Generator) -> list[BenchRequest]:
    requests = []
    for i in rng.permutation(len(data)):
        turns = data[i].get("conversations") if isinstance(data[i], dict) else None
        if not isinstance(turns, list):
            raise DatasetError(f"{path}: entry {i} has no 'conversations' list")
        if len(turns) < 2:
            continue
        prompt, answer = (_turn_text(path, i, t) for t in turns[:2])
        prompt_len, answer_len = text.count(prompt), text.count(answer)
        output_len = cfg.sharegpt_output_len or answer_len
        # vLLM's filter: drop tiny and overlong exchanges so runs compare.
        if prompt_len < _SHAREGPT_MIN or output_len < _SHAREGPT_MIN:
            continue
        if prompt_len > _SHAREGPT_MAX_PROMPT or prompt_len + output_len > _SHAREGPT_MAX_TOTAL:
            continue
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == cfg.num_prompts:
            break
    if not requests:
        raise DatasetError(f"{path}: no usable conversations (each needs two turns of 4+ tokens)")
    return _cycle(requests, cfg.num_prompts)


def _turn_text(path: Path, index: int, turn: object) -> str:
    value = turn.get("value") if isinstance(turn, dict) else None
    if not isinstance(value, str):
        raise DatasetError(f"{path}: entry {index} has a turn without a string 'value'")
    return value


def _prefix_repetition(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    prefixes = [text.make(cfg.prefix_repetition_prefix_len) for _ in range(cfg.prefix_repetition_num_prefixes)]
    requests = []
    for k in range(cfg.num_prompts):
        prefix = prefixes[k % len(prefixes)]
        prompt = prefix + " " + text.make(cfg.prefix_repetition_suffix_len)
        prompt_len = cfg.prefix_repetition_prefix_len + cfg.prefix_repetition_suffix_len
        requests.append(BenchRequest(prompt, prompt_len, cfg.prefix_repetition_output_len))
    order = rng.permutation(len(requests))  # interleave prefixes as independent users would
    return [requests[i] for i in order]


def _multiturn(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    turns = max(1, cfg.multiturn_num_turns)
    num_conversations = -(-cfg.num_prompts // turns)
    input_lens = sample_lengths(rng, cfg.random_input_len, cfg.random_range_ratio,
                                cfg.random_length_dist, cfg.num_prompts)
    output_lens = sample_lengths(rng, cfg.random_output_len, cfg.random_range_ratio,
                                 cfg.random_length_dist, cfg.num_prompts)
    # Conversation-major order with turns interleaved across conversations: all first turns, then
    # all second turns, so the runner can start every conversation before any history exists.
    requests = []
    for turn in range(turns):
        for conv in range(num_conversations):
            k = len(requests)
            if k == cfg.num_prompts:
                break
            requests.append(BenchRequest(text.make(input_lens[k]), input_lens[k], output_lens[k],
                                         conversation_id=conv, turn=turn))
    return requests


_COPY_INSTRUCTION = "Repeat the following passage exactly, word for word:\n\n"


def _copy(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    lens = sample_lengths(rng, cfg.random_input_len, cfg.random_range_ratio, cfg.random_length_dist,
                          cfg.num_prompts)
    instruction_len = text.count(_COPY_INSTRUCTION)
    requests = []
    for n in lens:
        passage = text.make(n)
        # The answer is the passage again: ask for about as many tokens as it holds.
        requests.append(BenchRequest(_COPY_INSTRUCTION + passage, instruction_len + n,
                                     min(n, cfg.random_output_len)))
    return requests


def _custom(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    if not cfg.dataset_path:
        raise DatasetError("--dataset-name custom needs --dataset-path FILE.jsonl")
    path = Path(cfg.dataset_path)
    requests = []
    hashed: dict[str, str] = {}  # a hashed prompt's stand-in text, the same for the same hash
    for line_no, row in jsonl_rows(path):
        prompt = _line_prompt(row, text, hashed) if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{path}:{line_no}: each line needs a non-empty string 'prompt' (or, as a recording "
                               f"with hashed prompts has, 'prompt_sha256' and a positive 'prompt_tokens')")
        output_len = row.get("output_tokens", row.get("max_tokens", cfg.custom_output_len))
        if not isinstance(output_len, int) or output_len < 1:
            raise DatasetError(f"{path}:{line_no}: 'output_tokens' must be a positive integer")
        requests.append(BenchRequest(prompt, text.count(prompt), output_len))
    if not requests:
        raise DatasetError(f"{path}: no requests (the file is empty)")
    return _cycle(requests, cfg.num_prompts)


def _line_prompt(row: dict, text: PromptText, hashed: dict[str, str]) -> str | None:
    """A line's prompt; a recording's hashed one (goodserve serve --record-prompts hash) becomes text of
    its token count."""
    if "prompt" in row or not isinstance(row.get("prompt_sha256"), str):
        return row.get("prompt")
    tokens = row.get("prompt_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        return None
    key = f"{row['prompt_sha256']}:{tokens}"
    if key not in hashed:
        hashed[key] = text.make(tokens)
    return hashed[key]


_SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"


def _sonnet(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    """vLLM's sonnet prompts: the instruction, the text's first lines up to --sonnet-prefix-len tokens
    (shared by every request: a prefix-cache workload), then lines drawn at random up to
    --sonnet-input-len."""
    from goodserve.bench.sonnets import SONNET_LINES

    lines = [line if line.endswith("\n") else line + "\n" for line in
             (_read_lines(Path(cfg.dataset_path)) if cfg.dataset_path else SONNET_LINES) if line.strip()]
    if not lines:
        raise DatasetError(f"{cfg.dataset_path}: no lines of text")
    if cfg.sonnet_prefix_len > cfg.sonnet_input_len:
        raise InvalidRequestError(f"--sonnet-prefix-len ({cfg.sonnet_prefix_len}) must not exceed "
                                  f"--sonnet-input-len ({cfg.sonnet_input_len})")
    base = text.count(_SONNET_INSTRUCTION)
    line_len = sum(text.count(line) for line in lines) / len(lines)
    num_input_lines = max(1, round((cfg.sonnet_input_len - base) / line_len))
    num_prefix_lines = min(num_input_lines, max(0, round((cfg.sonnet_prefix_len - base) / line_len)))
    prefix = [lines[i % len(lines)] for i in range(num_prefix_lines)]
    requests = []
    for _ in range(cfg.num_prompts):
        extra = [lines[i] for i in rng.integers(0, len(lines), size=num_input_lines - num_prefix_lines)]
        prompt = _SONNET_INSTRUCTION + "".join(prefix + extra)
        requests.append(BenchRequest(prompt, text.count(prompt), cfg.sonnet_output_len))
    return requests


_HF_PROMPT_FIELDS = ("prompt", "instruction", "question", "problem", "input", "text")
_HF_DEFAULT_OUTPUT_LEN = 256


def _hf(cfg: WorkloadConfig, text: PromptText, rng: np.random.Generator) -> list[BenchRequest]:
    """Rows of a dataset saved from the Hugging Face hub as JSON or JSONL: ShareGPT-style rows go
    through the sharegpt loader, others give their first prompt-like field."""
    if not cfg.dataset_path or not Path(cfg.dataset_path).is_file():
        raise DatasetError(
            f"--dataset-name hf reads a local JSON / JSONL file here (this machine does not reach the Hugging "
            f"Face hub), not {cfg.dataset_path!r}: save the dataset's rows first, e.g. "
            f"`datasets.load_dataset(ID, split='train').to_json('rows.jsonl')`, and give --dataset-path rows.jsonl")
    path = Path(cfg.dataset_path)
    raw = "\n".join(_read_lines(path))
    try:
        rows = json.loads(raw)
    except json.JSONDecodeError:
        rows = [row for _, row in jsonl_rows(path)]
    if isinstance(rows, dict):
        rows = next((v for v in rows.values() if isinstance(v, list)), [rows])
    if rows and isinstance(rows[0], dict) and "conversations" in rows[0]:
        return _sharegpt_rows(rows, path, replace(cfg, sharegpt_output_len=cfg.hf_output_len), text, rng)
    requests = []
    for i in rng.permutation(len(rows)):
        row = rows[i] if isinstance(rows[i], dict) else {}
        prompt = next((row[k] for k in _HF_PROMPT_FIELDS if isinstance(row.get(k), str) and row[k]), None)
        if prompt is None:
            raise DatasetError(f"{path}: row {i} has none of the prompt fields {_HF_PROMPT_FIELDS} "
                               "(or 'conversations')")
        requests.append(BenchRequest(prompt, text.count(prompt), cfg.hf_output_len or _HF_DEFAULT_OUTPUT_LEN))
    if not requests:
        raise DatasetError(f"{path}: no rows")
    return _cycle(requests, cfg.num_prompts)


def jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, its JSON) for each non-blank line of a JSONL file; a line that is not JSON is a
    DatasetError naming the file and line."""
    for number, line in enumerate(_read_lines(path), start=1):
        if line.strip():
            yield number, _json_line(path, number, line)


def _json_line(path: Path, number: int, line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from None


def _cycle(requests: list[BenchRequest], n: int) -> list[BenchRequest]:
    """Reuse a short file's requests in order until n are drawn."""
    return [BenchRequest(r.prompt, r.prompt_len, r.output_len) for r in
            (requests[i % len(requests)] for i in range(n))]


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"dataset file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc}") from None


def _read_json(path: Path) -> object:
    try:
        return json.loads("\n".join(_read_lines(path)))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
