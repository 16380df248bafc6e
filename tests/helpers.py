"""What tests reach inside an engine for, in one place.

A test about the server, a kernel or the scheduler that needs the loaded model, its runner or the
worker processes asks here, never `llm.engine.executor.worker.runner...` itself: when the engine's
inner shape changes, this file changes and those tests do not. Each function takes an LLM or an
Engine.
"""

from __future__ import annotations

import torch

from goodserve.engine.engine import Engine
from goodserve.llm import LLM


def engine_of(target: LLM | Engine) -> Engine:
    return target.engine if isinstance(target, LLM) else target


def executor_of(target: LLM | Engine):
    """The executor: the engine's one seam to its workers (execute_model, sample_tokens, shutdown)."""
    return engine_of(target).executor


def runner_of(target: LLM | Engine):
    """The ModelRunner of an engine whose worker runs in this process (no tensor or pipeline parallelism)."""
    return executor_of(target).worker.runner


def loaded_model(target: LLM | Engine) -> torch.nn.Module:
    """The model as loaded and quantized (its layers, kernels and native decode stack)."""
    return runner_of(target).model


def worker_processes(target: LLM | Engine) -> list:
    """The worker (rank) processes of an engine whose executor runs them, rank 0 first."""
    return executor_of(target)._processes


def shut_down(target: LLM | Engine) -> None:
    """Stop the engine's worker processes (if any) and release what they hold."""
    executor_of(target).shutdown()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with HF's own KV cache, never stopping at EOS."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
