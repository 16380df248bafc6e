"""Which speculative decoding method suits the measured workload (docs/diagnose.md).

Verifying k drafts costs about one decode step only while the batch is small (a step reads every
weight once however few tokens it holds); in a large batch the step is compute-bound and rejected
drafts cost real work, so speculation is off there. At a small batch the method follows where the
output comes from: copied from the prompt (a "repeat", edit or quote, the same code again) and
prompt lookup proposes it for free (ngram); written anew (chat) and only a model can guess it, the
one that exists for any model being its own weights quantized (self-draft). Copy-heavy is judged
by the measured acceptance of prompt lookup where the server ran it, else by how much of the output
prompt lookup would have predicted (bench's prompt_lookup_overlap).
"""

from __future__ import annotations

from dataclasses import dataclass

from goodserve.diagnose.observations import Observations

LARGE_BATCH = 8.0  # requests in flight; the engine's --spec-max-batch default stops proposing above it
COPY_HEAVY = 0.5  # share of output tokens prompt lookup gets right
MIN_OUTPUT_TOKENS = 16  # shorter answers leave too little decoding to speed up

OPTIONS = {"ngram": "--speculative-method ngram", "self:int4": "--speculative-model self:int4",
           "off": "no --speculative-method / --speculative-model (speculation off)"}


@dataclass(frozen=True)
class SpeculationAdvice:
    method: str  # "ngram" | "self:int4" | "off"
    option: str  # the flags that apply it
    why: str
    engine_method: str | None  # what the measured engine ran, in OPTIONS' names, when it was recorded

    @property
    def keeps(self) -> bool:
        """The engine already runs the recommended method."""
        return self.engine_method == self.method


def recommend_speculation(obs: Observations) -> SpeculationAdvice:
    engine_method = _engine_method(obs.engine or {})

    def advice(method: str, why: str) -> SpeculationAdvice:
        return SpeculationAdvice(method, OPTIONS[method], why, engine_method)

    if obs.concurrency > LARGE_BATCH:
        return advice("off", f"~{obs.concurrency:.1f} requests in flight: a decode step that large is compute-bound, "
                             "so rejected drafts cost real work")
    if obs.mean_output_len < MIN_OUTPUT_TOKENS:
        return advice("off", f"answers of ~{obs.mean_output_len:.0f} tokens leave little decoding to speed up")
    copied, measure = _copy_share(obs, engine_method)
    if copied is not None and copied >= COPY_HEAVY:
        return advice("ngram", f"{measure} {copied:.2f} at ~{obs.concurrency:.1f} requests in flight: the output "
                               "repeats its context, which prompt lookup proposes at no model cost")
    known = f" ({measure} {copied:.2f})" if copied is not None else ""
    return advice("self:int4", f"~{obs.concurrency:.1f} requests in flight and output written anew{known}: a "
                               "quantized copy of the model drafts any text, and a small batch verifies for ~1 step")


def _engine_method(engine: dict) -> str | None:
    """engine_config_info's speculation labels in OPTIONS' names: a draft model by its name."""
    method = engine.get("speculative_method")
    if method is None:
        return None
    if method == "draft":
        return engine.get("speculative_model")
    return "off" if method == "none" else method


def _copy_share(obs: Observations, engine_method: str | None) -> tuple[float | None, str]:
    """How much of the output prompt lookup gets right, and how that was measured."""
    if engine_method == "ngram" and obs.spec_acceptance_rate is not None:
        return obs.spec_acceptance_rate, "measured prompt-lookup acceptance"
    return obs.prompt_lookup_overlap, "prompt-lookup overlap"
