"""Speculative decoding on the CPU: the embedded model at batch 1, in one run,
- copy: `goodserve bench`'s `copy` workload ("repeat this passage" chat prompts whose answer copies
  the prompt), speculation off against prompt lookup (ngram) with each k given;
- chat: ordinary chat questions (CHAT_PROMPTS), speculation off against each quantized self-draft
  (--speculative-model self:int4 / self:gguf) with each k given;
- lookahead: the same chat questions (or with --lookahead-prompts code, code questions), speculation
  off and prompt lookup against lookahead decoding (--speculative-method lookahead) with each window
  W x N and k given;
output tok/s, acceptance rate, and whether the greedy outputs are identical (they must be);
- verify: what a step verifying k drafts costs against a decode step (gpu_spec_decode.py's verify
  table, on this CPU), for the float32 model and for gguf, whose decode steps run the native stack
  (model/native_decode.py), and its verify steps too, as one-token rows: the speculation policy's cost
  tables (engine/spec_decode/policy.py) come from it.

    PYTHONPATH=src python benchmarks/cpu_spec_decode.py     # writes $OUT/cpu_spec_decode_cpu.json
    PYTHONPATH=src python benchmarks/cpu_spec_decode.py --sections lookahead --tag lookahead
    PYTHONPATH=src python benchmarks/cpu_spec_decode.py --sections verify --tag verify   # ~1 minute

Requests run one at a time, each alone in its engine (batch 1), on each engine in turn.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from goodserve import LLM, SamplingParams
from goodserve.bench.text import PromptText
from goodserve.bench.workloads import BenchRequest, WorkloadConfig, build_workload
from gpu_spec_decode import part_verify
from result_file import write_result

# Ordinary assistant questions: answers in the model's own words, nothing to copy from the prompt.
CHAT_PROMPTS = [
    "What are three tips for staying healthy?",
    "Explain how photosynthesis works in simple terms.",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue?",
    "Describe the water cycle to a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
]

# Code questions: answers that repeat their own identifiers and syntax, nothing to copy from the prompt.
CODE_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that counts how often each word appears in a text.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that converts Celsius to Fahrenheit and back.",
    "Write a Python function that finds the largest element in a list.",
]


def run_interleaved(engines: dict[str, LLM], requests, params: list[SamplingParams]) -> dict[str, dict]:
    """Each request on every engine in turn (after one warm-up request each), so a change in the
    machine's load during the run weighs on every engine alike."""
    for llm in engines.values():
        llm.chat(requests[0].chat_messages(), params[0])
    before = {name: llm.engine.stats() for name, llm in engines.items()}
    tokens = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for request, p in zip(requests, params):
        for name, llm in engines.items():
            start = time.perf_counter()
            tokens[name].append(llm.chat(request.chat_messages(), p)[0].outputs[0].token_ids)
            seconds[name] += time.perf_counter() - start
    results = {}
    for name, llm in engines.items():
        stats, old = llm.engine.stats(), before[name]
        drafts = stats.spec_decode_num_draft_tokens - old.spec_decode_num_draft_tokens
        accepted = stats.spec_decode_num_accepted_tokens - old.spec_decode_num_accepted_tokens
        num_output = sum(map(len, tokens[name]))
        results[name] = {
            "output_tokens": num_output, "seconds": seconds[name], "output_tok_s": num_output / seconds[name],
            "steps": stats.num_steps - old.num_steps, "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "identical_outputs": tokens[name] == tokens["off"]}
        results[name]["speedup"] = results[name]["output_tok_s"] / results["off"]["output_tok_s"]
    return results


def copy_section(args, options: dict) -> dict:
    engines = {"off": LLM("smollm2-135m", **options)}
    for k in args.k:
        engines[f"ngram_k{k}"] = LLM("smollm2-135m", speculative_method="ngram", num_speculative_tokens=k, **options)
    cfg = WorkloadConfig(dataset_name="copy", num_prompts=args.num_prompts, random_input_len=args.input_len,
                         random_output_len=args.output_len)
    requests = build_workload(cfg, PromptText(engines["off"].tokenizer))
    params = [SamplingParams(temperature=0, max_tokens=r.output_len) for r in requests]
    return run_interleaved(engines, requests, params)


def chat_section(args, options: dict) -> dict:
    engines = {"off": LLM("smollm2-135m", **options)}
    for draft in args.self_drafts:
        for k in args.draft_k:
            engines[f"{draft}_k{k}"] = LLM("smollm2-135m", speculative_model=draft, num_speculative_tokens=k,
                                           **options)
    requests = [BenchRequest(prompt, 0, args.chat_output_len) for prompt in CHAT_PROMPTS[: args.num_chat_prompts]]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len) for r in requests]
    return run_interleaved(engines, requests, params)


def lookahead_section(args, options: dict) -> dict:
    """Beside speculation off, prompt lookup alone with each k: what lookahead's window adds to the
    n-grams the answer repeats."""
    engines = {"off": LLM("smollm2-135m", **options)}
    for k in args.lookahead_k:
        engines[f"ngram_k{k}"] = LLM("smollm2-135m", speculative_method="ngram", num_speculative_tokens=k, **options)
    for window in args.lookahead:
        width, ngram = map(int, window.split("x"))
        for k in args.lookahead_k:
            engines[f"lookahead_w{width}n{ngram}_k{k}"] = LLM(
                "smollm2-135m", speculative_method="lookahead", lookahead_window=width, lookahead_ngram=ngram,
                num_speculative_tokens=k, **options)
    prompts = {"chat": CHAT_PROMPTS, "code": CODE_PROMPTS}[args.lookahead_prompts]
    requests = [BenchRequest(prompt, 0, args.chat_output_len) for prompt in prompts[: args.num_chat_prompts]]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len) for r in requests]
    return run_interleaved(engines, requests, params)


VERIFY_BATCHES, VERIFY_KS, VERIFY_CONTEXT = (1, 4), (1, 2, 4), 300


def verify_section(args, options: dict) -> dict:
    result = {}
    for quantization in ("gguf", "none"):
        # the runner's token buffers hold max_num_seqs x (1 + k) rows: twice the largest batch fits its cells
        llm = LLM("smollm2-135m", **{**options, "quantization": quantization}, speculative_method="ngram",
                  num_speculative_tokens=max(VERIFY_KS), max_num_seqs=2 * max(VERIFY_BATCHES))
        part_verify(llm, f"smollm2-135m {quantization}", VERIFY_CONTEXT, 2, 7, result.setdefault(quantization, {}),
                    batches=VERIFY_BATCHES, ks=VERIFY_KS)
        del llm
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8], help="ngram's num_speculative_tokens, one each")
    parser.add_argument("--num-chat-prompts", type=int, default=len(CHAT_PROMPTS))
    parser.add_argument("--chat-output-len", type=int, default=128)
    parser.add_argument("--self-drafts", nargs="*", default=["self:int4", "self:gguf"])
    parser.add_argument("--draft-k", type=int, nargs="+", default=[4], help="self-drafts' num_speculative_tokens")
    parser.add_argument("--lookahead", nargs="+", default=["2x3"], help="lookahead windows, WxN: W columns, N-gram")
    parser.add_argument("--lookahead-k", type=int, nargs="+", default=[4], help="lookahead's num_speculative_tokens")
    parser.add_argument("--lookahead-prompts", choices=["chat", "code"], default="chat",
                        help="lookahead's questions: CHAT_PROMPTS or CODE_PROMPTS")
    parser.add_argument("--sections", nargs="+", default=["copy", "chat"],
                        choices=["copy", "chat", "lookahead", "verify"])
    parser.add_argument("--quantization", default="none", help="none: the float32 model; gguf: the CPU default")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    options = dict(quantization=args.quantization, cpu_kv_cache_bytes=256 << 20)
    sections = {"copy": copy_section, "chat": chat_section, "lookahead": lookahead_section, "verify": verify_section}
    result = {"tag": args.tag, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "args": vars(args),
              **{name: sections[name](args, options) for name in args.sections}}
    print(json.dumps(result, indent=1))
    write_result(f"cpu_spec_decode_{args.tag}.json", result)


if __name__ == "__main__":
    main()
