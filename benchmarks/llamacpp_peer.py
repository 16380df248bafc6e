"""llama.cpp on the same GGUF file, as benchmarks/cpu_engine.py's peer (run by it as a subprocess).

Runs in its own venv (/work/shared/peers/llamacpp-setup.sh: the llama-cpp-cffi wheel, plus an
LD_PRELOAD shim), so it imports neither torch nor goodserve. Reads one JSON job on stdin, writes one
JSON result on stdout:
  {"mode": "single", "model": path, "prompt": [ids], "new_tokens": n, "threads": t}
      -> greedy decode of n tokens after the prompt: {"decode_tok_s", "e2e_tok_s", "token_ids"}
  {"mode": "offline", "model": path, "prompts": [[ids], ...], "new_tokens": n, "threads": t}
      -> every prompt prefilled, then all decoded together, one token per sequence a step (what
         goodserve's offline mode does): {"seconds", "output_tok_s"}
Token ids come from goodserve's tokenizer, so both engines see the same prompt.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from llama.llama_cpp import ffi, lib


def load(path: str, n_ctx: int, n_seqs: int, threads: int):
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, 2048, 512, n_seqs
    params.n_threads = params.n_threads_batch = threads
    return model, lib.llama_init_from_model(model, params)


def argmax(ctx, index: int, vocab: int) -> int:
    logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, index), 4 * vocab), dtype=np.float32)
    return int(logits.argmax())


class Batch:
    """A llama_batch of up to `capacity` tokens, each for one sequence."""

    def __init__(self, capacity: int, n_seqs: int):
        self.raw = lib.llama_batch_init(capacity, 0, n_seqs)

    def fill(self, entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits)
        for i, (token, pos, seq, logits) in enumerate(entries):
            self.raw.token[i], self.raw.pos[i], self.raw.n_seq_id[i] = token, pos, 1
            self.raw.seq_id[i][0], self.raw.logits[i] = seq, logits
        self.raw.n_tokens = len(entries)


def decode(ctx, batch: Batch) -> None:
    if lib.llama_decode(ctx, batch.raw) != 0:
        raise RuntimeError("llama_decode failed")


def single(job: dict) -> dict:
    prompt, n = job["prompt"], job["new_tokens"]
    model, ctx = load(job["model"], len(prompt) + n + 16, 1, job["threads"])
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = Batch(max(len(prompt), 1), 1)
    start = time.perf_counter()
    batch.fill([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    decode(ctx, batch)
    tokens = [argmax(ctx, len(prompt) - 1, vocab)]
    first = time.perf_counter()
    while len(tokens) < n:
        batch.fill([(tokens[-1], len(prompt) + len(tokens) - 1, 0, True)])
        decode(ctx, batch)
        tokens.append(argmax(ctx, 0, vocab))
    end = time.perf_counter()
    return {"decode_tok_s": (n - 1) / (end - first), "e2e_tok_s": n / (end - start), "token_ids": tokens}


def offline(job: dict) -> dict:
    prompts, n = job["prompts"], job["new_tokens"]
    model, ctx = load(job["model"], sum(len(p) + n for p in prompts) + 64, len(prompts), job["threads"])
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = Batch(max(2048, len(prompts)), len(prompts))
    start = time.perf_counter()
    last = []
    for seq, prompt in enumerate(prompts):  # one sequence's prompt per call, as its prefill
        batch.fill([(t, i, seq, i == len(prompt) - 1) for i, t in enumerate(prompt)])
        decode(ctx, batch)
        last.append(argmax(ctx, len(prompt) - 1, vocab))
    for step in range(1, n):
        batch.fill([(last[s], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
        decode(ctx, batch)
        last = [argmax(ctx, s, vocab) for s in range(len(prompts))]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tok_s": len(prompts) * n / seconds}


if __name__ == "__main__":
    lib.llama_backend_init()
    job = json.load(sys.stdin)
    print(json.dumps({"single": single, "offline": offline}[job["mode"]](job)))
