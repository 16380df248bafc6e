"""Speculative decoding on the CPU (issue 15): the embedded model at batch 1 on `goodserve bench`'s
`copy` workload ("repeat this passage" chat prompts whose answer copies the prompt), speculation off
against prompt lookup (ngram) with each k given, in one run: output tok/s, acceptance rate, and
whether the greedy outputs are identical (they must be).

    PYTHONPATH=src python benchmarks/cpu_spec_decode.py     # writes $OUT/cpu_spec_decode.json

Requests run one at a time, each alone in the engine (batch 1), after one warm-up request per engine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from goodserve import LLM, SamplingParams
from goodserve.bench.text import PromptText
from goodserve.bench.workloads import WorkloadConfig, build_workload
from result_file import write_result


def run(llm: LLM, requests, params: list[SamplingParams]) -> dict:
    llm.chat(requests[0].chat_messages(), params[0])  # warm-up
    before = llm.engine.stats()
    tokens, start = [], time.perf_counter()
    for request, p in zip(requests, params):
        tokens.append(llm.chat(request.chat_messages(), p)[0].outputs[0].token_ids)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    drafts = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    num_output = sum(map(len, tokens))
    return {"output_tokens": num_output, "seconds": seconds, "output_tok_s": num_output / seconds,
            "steps": stats.num_steps - before.num_steps, "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else None, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8], help="num_speculative_tokens, one run each")
    parser.add_argument("--quantization", default="none", help="none: the float32 model; gguf: the CPU default")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    options = dict(quantization=args.quantization, cpu_kv_cache_bytes=256 << 20)
    off = LLM("smollm2-135m", **options)
    cfg = WorkloadConfig(dataset_name="copy", num_prompts=args.num_prompts, random_input_len=args.input_len,
                         random_output_len=args.output_len)
    requests = build_workload(cfg, PromptText(off.tokenizer))
    params = [SamplingParams(temperature=0, max_tokens=r.output_len) for r in requests]
    baseline = run(off, requests, params)
    del off
    result = {"tag": args.tag, "machine": platform.processor() or platform.machine(), "args": vars(args),
              "off": baseline}
    for k in args.k:
        ngram = run(LLM("smollm2-135m", speculative_method="ngram", num_speculative_tokens=k, **options),
                    requests, params)
        ngram["identical_outputs"] = ngram.pop("tokens") == baseline["tokens"]
        ngram["speedup"] = ngram["output_tok_s"] / baseline["output_tok_s"]
        result[f"ngram_k{k}"] = ngram
    del baseline["tokens"]
    print(json.dumps(result, indent=1))
    write_result(f"cpu_spec_decode_{args.tag}.json", result)


if __name__ == "__main__":
    main()
