"""Speculative decoding on the CPU (issue 15): the embedded model at batch 1 on `goodserve bench`'s
`copy` workload ("repeat this passage" chat prompts whose answer copies the prompt), speculation off
against prompt lookup (ngram) with each k given, in one run: output tok/s, acceptance rate, and
whether the greedy outputs are identical (they must be).

    PYTHONPATH=src python benchmarks/cpu_spec_decode.py     # writes $OUT/cpu_spec_decode.json

Requests run one at a time, each alone in its engine (batch 1), on each engine in turn.
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
    return results


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
    engines = {"off": LLM("smollm2-135m", **options)}
    for k in args.k:
        engines[f"ngram_k{k}"] = LLM("smollm2-135m", speculative_method="ngram", num_speculative_tokens=k, **options)
    cfg = WorkloadConfig(dataset_name="copy", num_prompts=args.num_prompts, random_input_len=args.input_len,
                         random_output_len=args.output_len)
    requests = build_workload(cfg, PromptText(engines["off"].tokenizer))
    params = [SamplingParams(temperature=0, max_tokens=r.output_len) for r in requests]
    result = {"tag": args.tag, "machine": platform.processor() or platform.machine(), "args": vars(args),
              **run_interleaved(engines, requests, params)}
    for k in args.k:
        result[f"ngram_k{k}"]["speedup"] = result[f"ngram_k{k}"]["output_tok_s"] / result["off"]["output_tok_s"]
    print(json.dumps(result, indent=1))
    write_result(f"cpu_spec_decode_{args.tag}.json", result)


if __name__ == "__main__":
    main()
