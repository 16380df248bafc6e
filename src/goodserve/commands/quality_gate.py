"""The quality gate: does an engine configuration still compute what the plain engine computes?

A candidate EngineConfig (quantized weights, a quantized KV cache, prefix caching, kernels, ...)
runs the same work as the unoptimized baseline on the same model:
- perplexity on an offline text (Python's own documentation, pydoc_data.topics, by default), in
  non-overlapping windows read through prompt logprobs;
- top-1 agreement: how often the candidate's most likely next token at each text position is the
  baseline's;
- greedy agreement over a prompt set: the share of generated tokens before the first divergence.
Each metric is checked against a threshold; defaults depend on what the candidate changes.
A candidate with speculative decoding is also checked against itself without it (the baseline's run
when that is the same configuration): speculation is exact, so all three must agree exactly.
The engines run one after the other, so a GPU only ever holds one model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from goodserve.config import EngineConfig
from goodserve.errors import InvalidRequestError
from goodserve.sampling_params import SamplingParams

# What "unoptimized" means: full-precision weights and KV, no cache reuse, reference attention,
# eager execution, no speculation. Every other field keeps the candidate's value, so both run the
# same model.
BASELINE_OPTIONS = {"quantization": "none", "kv_cache_dtype": "auto", "enable_prefix_caching": False,
                    "attention_backend": "torch", "enforce_eager": True, "speculative_method": None,
                    "speculative_model": None}

# A shared preamble longer than a KV block, so a candidate with prefix caching reuses it.
PREAMBLE = ("You are a careful assistant who answers questions about programming, science and history "
            "in clear, complete sentences.\n\n")
QUESTIONS = [
    "What does a Python list comprehension do?",
    "Why is the sky blue?",
    "Explain what a hash table is.",
    "Who was Ada Lovelace?",
    "What is the difference between a process and a thread?",
    "How does photosynthesis work?",
    "What is recursion in programming?",
    "Why do we have seasons on Earth?",
    "What is a compiler?",
    "Describe the water cycle.",
    "What does HTTP stand for and what is it used for?",
    "What causes earthquakes?",
    "What is the purpose of a unit test?",
    "Who built the first printing press in Europe?",
    "What is binary search?",
    "How do vaccines work?",
]


# (stage, done, total): e.g. ("baseline: text windows", 8, 16). Called when a stage starts and
# after each part of it, so a caller can draw progress through the minutes an evaluation takes.
ProgressHook = Callable[[str, int, int], None]


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


@dataclass
class EvalSettings:
    text_file: str | None = None  # default: pydoc_data.topics
    max_text_tokens: int = 4096
    window: int = 256
    prompts: list[str] = field(default_factory=lambda: [f"{PREAMBLE}Question: {q}\nAnswer:" for q in QUESTIONS])
    max_new_tokens: int = 32

    def validate(self) -> None:
        """Fail before any model loads."""
        if self.text_file is not None and not Path(self.text_file).is_file():
            raise InvalidRequestError(f"text file {self.text_file} does not exist")
        if self.window < 2 or self.max_text_tokens < self.window:
            raise InvalidRequestError("need window >= 2 and max_text_tokens >= window")
        if not self.prompts or self.max_new_tokens < 1:
            raise InvalidRequestError("need at least one greedy prompt and max_new_tokens >= 1")


@dataclass
class Thresholds:
    max_perplexity_increase: float  # relative: 0.01 = candidate perplexity at most 1% above baseline
    min_top1_agreement: float
    min_greedy_agreement: float


@dataclass
class RunResult:
    """What one configuration computed: per text window, the log-probability of each actual next
    token and the top-1 token at each position; per prompt, the greedy continuation."""

    token_logprobs: list[list[float]]
    top1_tokens: list[list[int]]
    greedy_tokens: list[list[int]]
    seconds: float  # the workload only, not loading
    draft_tokens: int = 0  # speculative decoding: tokens proposed and verified, and of those kept
    accepted_tokens: int = 0


# (perplexity increase, top-1 agreement drop, greedy agreement drop) each lossy change may cost.
# Set from benchmarks/results/quant_quality_smollm2-135m.json with margin: greedy agreement over
# 32 tokens is harsh on a 135M model (one near-tie flip ends the shared prefix), so its budgets are wide.
LOSS_BUDGETS = {
    ("quantization", "int8"): (0.01, 0.04, 0.45),
    ("quantization", "int4"): (0.10, 0.18, 0.80),
    # e4m3 keeps 3 mantissa bits of weights and activations: on the 135M model +3.4% perplexity, top-1
    # 0.89, greedy 0.47 (quant_quality_smollm2-135m_fp8.json).
    ("quantization", "fp8"): (0.05, 0.14, 0.60),
    # The file's own weights (the baseline dequantizes the same codes); decode rounds the int4
    # kernel's inputs and outputs to bf16, which can flip near-ties.
    ("quantization", "gguf"): (0.0, 0.02, 0.20),
    ("kv_cache_dtype", "int8"): (0.01, 0.03, 0.30),
    ("kv_cache_dtype", "fp8"): (0.03, 0.06, 0.45),
}
# Changes meant to be exact (kernels, graphs, batch shapes, prefix reuse) leave rounding noise only,
# and its size follows the dtype's mantissa. In 16 bits another attention kernel flips near-ties: the
# embedded model in bf16 on an H100, Triton attention with CUDA graphs against torch attention, eager,
# kept perplexity (-0.19%) and moved top-1 agreement to 0.974 and greedy agreement to 0.71.
EXACT_THRESHOLDS = {"float32": (0.005, 0.98, 0.90), "bfloat16": (0.01, 0.95, 0.50), "float16": (0.01, 0.95, 0.50)}
# Speculative decoding is exact (engine/spec_decode/acceptance.py): against the same configuration
# without it, not one greedy token, top-1 token or perplexity digit may move.
SPECULATION_THRESHOLDS = (0.0, 1.0, 1.0)


def default_thresholds(resolved: EngineConfig) -> Thresholds:
    """Budgets add up over the lossy changes the candidate makes, from its dtype's rounding floor
    (resolved: the dtype and quantization the engine runs, as resolve_for_device gives them)."""
    ppl, top1, greedy = EXACT_THRESHOLDS[resolved.dtype]
    for (name, value), (d_ppl, d_top1, d_greedy) in LOSS_BUDGETS.items():
        if getattr(resolved, name) == value:
            ppl, top1, greedy = ppl + d_ppl, top1 - d_top1, greedy - d_greedy
    return Thresholds(ppl, max(top1, 0.0), max(greedy, 0.0))


def evaluation_text(text_file: str | None) -> tuple[str, str]:
    """(source name, text)."""
    if text_file is None:
        from pydoc_data.topics import topics

        return "pydoc_data.topics", "\n\n".join(topics[name] for name in sorted(topics))
    return text_file, Path(text_file).read_text(encoding="utf-8", errors="replace")


def text_windows(token_ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens from the first `max_tokens`; a short tail is dropped."""
    usable = token_ids[:max_tokens]
    windows = [usable[i:i + window] for i in range(0, len(usable) - window + 1, window)]
    if not windows:
        raise InvalidRequestError(f"the text has {len(token_ids)} tokens, fewer than one {window}-token window")
    return windows


@dataclass
class Workload:
    text_source: str
    windows: list[list[int]]  # perplexity / top-1 text windows
    prompts: list[list[int]]  # greedy prompts


def build_workload(tokenizer, settings: EvalSettings) -> Workload:
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, which the evaluation text needs")
    source, text = evaluation_text(settings.text_file)
    # Tokenize only a prefix of a long text: a few characters per token is plenty of margin.
    token_ids = tokenizer.encode(text[: settings.max_text_tokens * 8], add_special_tokens=False)
    windows = text_windows(token_ids, settings.window, settings.max_text_tokens)
    return Workload(source, windows, [tokenizer.encode(p) for p in settings.prompts])


def measure(config: EngineConfig, settings: EvalSettings, workload: Workload | None = None,
            on_progress: ProgressHook = _no_progress, label: str = "") -> tuple[Workload, RunResult]:
    """Open an engine for `config`, run the workload (built from its tokenizer when not given),
    and free the engine before returning, so the next configuration has the memory."""
    from goodserve.llm import LLM

    on_progress(f"{label}: loading the engine", 0, 1)
    with LLM(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}) as llm:  # nested options kept
        on_progress(f"{label}: loading the engine", 1, 1)
        workload = workload or build_workload(llm.tokenizer, settings)
        result = run_workload(llm, workload, settings.max_new_tokens,
                              lambda stage, done, total: on_progress(f"{label}: {stage}", done, total))
    return workload, result


def run_workload(llm, workload: Workload, max_new_tokens: int,
                 on_progress: ProgressHook = _no_progress) -> RunResult:
    start = time.perf_counter()
    before = llm.engine.stats()
    windows = workload.windows
    # As many windows a call as one engine step holds: progress to report, and no batching lost.
    per_call = max(1, llm.engine.config.max_num_batched_tokens // len(windows[0]))
    scored = []
    on_progress("text windows", 0, len(windows))
    for first in range(0, len(windows), per_call):
        scored += llm.generate([{"prompt_token_ids": w} for w in windows[first:first + per_call]],
                               SamplingParams(max_tokens=1, prompt_logprobs=1))
        on_progress("text windows", len(scored), len(windows))
    logprobs, top1 = zip(*(_score_window(w, out.prompt_logprobs) for w, out in zip(windows, scored)))
    greedy_params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    # The first prompt alone first: with prefix caching on, the others then reuse its preamble.
    prompts = workload.prompts
    outputs = []
    on_progress("greedy prompts", 0, len(prompts))
    for part in (prompts[:1], prompts[1:]):
        if part:
            outputs += llm.generate([{"prompt_token_ids": p} for p in part], greedy_params)
            on_progress("greedy prompts", len(outputs), len(prompts))
    greedy = [list(out.outputs[0].token_ids) for out in outputs]
    after = llm.engine.stats()
    return RunResult(list(logprobs), list(top1), greedy, time.perf_counter() - start,
                     after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                     after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)


def _score_window(window: list[int], prompt_logprobs: list) -> tuple[list[float], list[int]]:
    logprobs, top1 = [], []
    for token, entry in zip(window[1:], prompt_logprobs[1:]):
        logprobs.append(entry[token].logprob)
        top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return logprobs, top1


def perplexity(token_logprobs: list[list[float]]) -> float:
    flat = [lp for window in token_logprobs for lp in window]
    return math.exp(-sum(flat) / len(flat))


def common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(baseline: RunResult, candidate: RunResult) -> dict[str, float]:
    base_ppl, cand_ppl = perplexity(baseline.token_logprobs), perplexity(candidate.token_logprobs)
    pairs = [(b, c) for bw, cw in zip(baseline.top1_tokens, candidate.top1_tokens) for b, c in zip(bw, cw)]
    logprob_pairs = [(b, c) for bw, cw in zip(baseline.token_logprobs, candidate.token_logprobs)
                     for b, c in zip(bw, cw)]
    prefixes = [common_prefix_length(b, c) / max(len(b), 1)
                for b, c in zip(baseline.greedy_tokens, candidate.greedy_tokens)]
    return {
        "baseline_perplexity": base_ppl,
        "candidate_perplexity": cand_ppl,
        "perplexity_increase": cand_ppl / base_ppl - 1.0,
        "top1_agreement": sum(b == c for b, c in pairs) / len(pairs),
        "mean_abs_logprob_diff": sum(abs(b - c) for b, c in logprob_pairs) / len(logprob_pairs),
        "greedy_agreement": sum(prefixes) / len(prefixes),
        "greedy_exact_match": sum(b == c for b, c in zip(baseline.greedy_tokens, candidate.greedy_tokens))
        / len(prefixes),
    }


def checks(metrics: dict[str, float], thresholds: Thresholds) -> list[dict]:
    rows = [("perplexity_increase", metrics["perplexity_increase"], "<=", thresholds.max_perplexity_increase),
            ("top1_agreement", metrics["top1_agreement"], ">=", thresholds.min_top1_agreement),
            ("greedy_agreement", metrics["greedy_agreement"], ">=", thresholds.min_greedy_agreement)]
    return [{"metric": name, "value": value, "op": op, "limit": limit,
             "passed": value <= limit if op == "<=" else value >= limit} for name, value, op, limit in rows]


def changed_options(config: EngineConfig, reference: EngineConfig) -> dict:
    base = dataclasses.asdict(reference)
    return {k: v for k, v in dataclasses.asdict(config).items() if base[k] != v}


def evaluate(candidate: EngineConfig, settings: EvalSettings, thresholds: Thresholds | None = None,
             on_progress: ProgressHook = _no_progress) -> dict:
    """Run baseline and candidate; return the JSON-ready report (its "passed" is the verdict)."""
    settings.validate()
    # What the engine will run (an unset quantization is gguf for a GGUF model on the CPU), so the
    # report and the loss budgets name it.
    from goodserve.engine.setup.config_resolution import resolve_for_device

    resolved = resolve_for_device(candidate)
    # Unquantized is "none", the baseline's spelling, so a candidate can be the baseline's equal.
    candidate = dataclasses.replace(candidate, quantization=resolved.quantization or "none")
    if candidate.quantization_awq and candidate.quantization == "none":
        raise InvalidRequestError("--quantization-awq scales weights for quantization: add --quantization int8 or int4")
    thresholds = thresholds or default_thresholds(resolved)
    baseline = dataclasses.replace(candidate, **BASELINE_OPTIONS)
    workload, base_run = measure(baseline, settings, on_progress=on_progress, label="baseline")
    _, cand_run = measure(candidate, settings, workload, on_progress, "candidate")
    metrics = compare(base_run, cand_run)
    rows = checks(metrics, thresholds)
    report = {
        "model": candidate.model,
        "differs_from_baseline": changed_options(candidate, baseline),
        "baseline": dataclasses.asdict(baseline),
        "candidate": dataclasses.asdict(candidate),
        "text": {"source": workload.text_source, "windows": len(workload.windows),
                 "window_tokens": settings.window, "scored_tokens": sum(len(w) - 1 for w in workload.windows)},
        "greedy": {"prompts": len(workload.prompts), "max_new_tokens": settings.max_new_tokens},
        "metrics": metrics,
        "thresholds": dataclasses.asdict(thresholds),
        "checks": rows,
        "passed": all(row["passed"] for row in rows),
        "seconds": {"baseline": base_run.seconds, "candidate": cand_run.seconds},
    }
    if candidate.speculative_method or candidate.speculative_model:
        report["speculation"] = speculation_check(candidate, baseline, base_run, cand_run, workload, settings,
                                                  on_progress)
        report["passed"] = report["passed"] and report["speculation"]["passed"]
    return report


def speculation_check(candidate: EngineConfig, baseline: EngineConfig, base_run: RunResult, cand_run: RunResult,
                      workload: Workload, settings: EvalSettings, on_progress: ProgressHook) -> dict:
    """The candidate against itself without speculation (the baseline's run, when that is the same
    configuration): speculation must change nothing. With how many drafts it kept."""
    plain = dataclasses.replace(candidate, speculative_method=None, speculative_model=None)
    plain_run = base_run if plain == baseline else measure(plain, settings, workload, on_progress,
                                                          "candidate without speculation")[1]
    metrics = compare(plain_run, cand_run)
    rows = checks(metrics, Thresholds(*SPECULATION_THRESHOLDS))
    drafted, accepted = cand_run.draft_tokens, cand_run.accepted_tokens
    return {
        "method": candidate.speculative_model or candidate.speculative_method,
        "reference": "baseline" if plain == baseline else "candidate without speculation",
        "metrics": metrics,
        "checks": rows,
        "passed": all(row["passed"] for row in rows),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }
