"""Speculative decoding as a bench run saw it: the server's counters (vLLM's names under goodserve:,
server/metrics.py), scraped after the warm-up and after the run; their differences are the run's.
Other traffic to the server meanwhile counts too. And for any server, how much of the output prompt
lookup would have predicted (`prompt_lookup_overlap`), which `goodserve diagnose` reads.

The result keys are `vllm bench serve`'s: draft tokens, accepted tokens, drafts (verifications: one
sequence's proposals checked in one step), acceptance rate in percent (accepted / draft tokens),
acceptance length (1 + accepted / drafts: the tokens a verification writes, its target's own token
included) and per position j the share of drafts whose token j was kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from goodserve.bench.engine_config import fetch_metrics_text

PREFIX = "goodserve:spec_decode_"


@dataclass(frozen=True)
class SpecDecodeCounts:
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: tuple[float, ...]

    def __sub__(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        earlier = before.accepted_per_pos + (0.0,) * (len(self.accepted_per_pos) - len(before.accepted_per_pos))
        return SpecDecodeCounts(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                                self.num_accepted_tokens - before.num_accepted_tokens,
                                tuple(a - b for a, b in zip(self.accepted_per_pos, earlier)))


def parse_spec_decode_counts(metrics_text: str) -> SpecDecodeCounts | None:
    """The counters summed over model names; None when the server has none (speculation off, not goodserve)."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name == sample.name or not name.endswith("_total"):
                continue
            if name == "num_accepted_tokens_per_pos_total":
                position = int(sample.labels["position"])
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    if "num_drafts_total" not in totals:
        return None
    return SpecDecodeCounts(totals["num_drafts_total"], totals.get("num_draft_tokens_total", 0.0),
                            totals.get("num_accepted_tokens_total", 0.0),
                            tuple(per_pos.get(j, 0.0) for j in range(max(per_pos, default=-1) + 1)))


def fetch_spec_decode_counts(metrics_url: str, api_key: str | None = None) -> SpecDecodeCounts | None:
    text = fetch_metrics_text(metrics_url, api_key)
    try:
        return None if text is None else parse_spec_decode_counts(text)
    except ValueError:  # not Prometheus text
        return None


def spec_decode_metrics(run: SpecDecodeCounts) -> dict:
    """The result-JSON block for one run's counts (rates None when nothing was drafted)."""
    drafts, draft_tokens, accepted = run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens else None,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "spec_decode_per_position_acceptance_rates": [n / drafts for n in run.accepted_per_pos] if drafts else [],
    }


def prompt_lookup_overlap(texts: list[tuple[str, str]], tokenizer=None) -> float | None:
    """Over (prompt, output) pairs, the share of output tokens prompt lookup predicts (None: none).
    Tokens of the bench's tokenizer, the engine's unit, or words where there is none."""
    split = (lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer else str.split
    counts = [prompt_lookup_hits(split(prompt), split(output)) for prompt, output in texts]
    total = sum(n for _, n in counts)
    return sum(hits for hits, _ in counts) / total if total else None


def prompt_lookup_hits(prompt: list, output: list, ngram_max: int = 4) -> tuple[int, int]:
    """(tokens predicted, tokens) of output: a token counts as predicted when it follows the latest
    earlier occurrence of the longest suffix (ngram_max tokens down to one) of the sequence before
    it, the prompt included: what prompt lookup (engine/spec_decode/ngram.py) would propose first."""
    tokens = [*prompt, *output]
    after: dict[tuple, int] = {}  # n-gram -> the index of the token after its latest occurrence
    hits = 0
    for i in range(len(tokens)):  # predict tokens[i] from tokens[:i]
        if i >= len(prompt):
            hits += _follower(after, tokens, i, ngram_max) == tokens[i]
        for n in range(1, min(ngram_max, i) + 1):  # tokens[:i]'s suffixes are earlier occurrences from now on
            after[tuple(tokens[i - n:i])] = i
    return hits, len(output)


def _follower(after: dict[tuple, int], tokens: list, i: int, ngram_max: int):
    for n in range(min(ngram_max, i), 0, -1):
        at = after.get(tuple(tokens[i - n:i]))
        if at is not None:
            return tokens[at]
    return None
