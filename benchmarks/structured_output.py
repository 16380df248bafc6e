"""What structured output costs in throughput: the same offline batch through `LLM`, all
requests free, then half of them (every other one) constrained by a json_schema.

Both runs generate exactly the same number of tokens: free requests ignore EOS, and the schemas
ask for arrays of at least MIN_ITEMS objects, which max_tokens always cuts first, so every request
ends by length and only the time per token differs. A third run, all free with async scheduling
off, shows how much of the cost is the pipelining a constrained sequence gives up (its mask needs
the previous token on the host; engine/frontend/grammar.py), where the engine pipelines (CUDA graphs).

    CPU:  PYTHONPATH=src python benchmarks/structured_output.py                  # embedded model
    GPU:  PYTHONPATH=src python benchmarks/structured_output.py --model dummy:llama-3.1-8b \
              --tokenizer DIR --num-requests 256 --max-tokens 256 --tag h100
Writes $OUT/structured_output_<tag>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time

import torch

from goodserve import LLM, SamplingParams, StructuredOutputsParams
from result_file import write_result

MIN_ITEMS = 100
ITEMS = [
    {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                      "in_stock": {"type": "boolean"}}, "required": ["id", "name", "in_stock"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "number"},
                                      "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
     "required": ["city", "temp", "sky"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "email": {"type": "string"}, "age": {"type": "integer"}}, "required": ["email", "age"]},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["user", "tags"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                      "rating": {"enum": [1, 2, 3, 4, 5]}}, "required": ["title", "year", "rating"]},
]
SUBJECTS = ["products in a shop", "weather reports", "users and their tags", "films and ratings"]


def schema(i: int) -> dict:
    return {"type": "array", "minItems": MIN_ITEMS, "items": ITEMS[i % len(ITEMS)]}


def prompts(llm: LLM, count: int) -> list[dict]:
    tokenizer = llm.tokenizer
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"List {MIN_ITEMS} {SUBJECTS[i % len(SUBJECTS)]} (batch {i}) as a "
                                                f"JSON array following this schema: {json.dumps(schema(i))}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return out


def params(count: int, max_tokens: int, constrained: bool) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                           structured_outputs=StructuredOutputsParams(json=schema(i))
                           if constrained and i % 2 == 0 else None)
            for i in range(count)]


def timed_run(llm: LLM, batch: list[dict], sampling: list[SamplingParams]) -> dict:
    engine = llm.engine
    steps, pipelined = engine.steps.num_steps, engine.steps.num_pipelined_steps
    start = time.perf_counter()
    outputs = llm.generate(batch, sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    reasons = sorted({o.outputs[0].finish_reason for o in outputs})
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds, "finish_reasons": reasons,
            "steps": engine.steps.num_steps - steps, "pipelined_steps": engine.steps.num_pipelined_steps - pipelined}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (dummy models on the GPU)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    options = {"tokenizer": args.tokenizer} if args.tokenizer else {}
    llm = LLM(args.model, max_num_seqs=max(args.num_requests, 1), **options)
    batch = prompts(llm, args.num_requests)
    # Warm-up: compiles the schemas and puts every prompt in the prefix cache, so each timed run
    # (the first included) does the same work.
    llm.generate(batch, params(len(batch), 2, constrained=True))
    runs: dict[str, list[dict]] = {"free": [], "mixed": [], "free_sync": []}
    for _ in range(args.repeats):  # interleaved, so a drifting machine affects both alike
        runs["free"].append(timed_run(llm, batch, params(len(batch), args.max_tokens, constrained=False)))
        runs["mixed"].append(timed_run(llm, batch, params(len(batch), args.max_tokens, constrained=True)))
    del llm  # the same engine with async scheduling off, warmed up alike
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(args.model, max_num_seqs=max(args.num_requests, 1), async_scheduling=False, **options)
    llm.generate(batch, params(len(batch), 2, constrained=True))
    runs["free_sync"].append(timed_run(llm, batch, params(len(batch), args.max_tokens, constrained=False)))
    # The best run of each: this shared machine's speed wanders, and only ever downwards.
    best = {name: max(r["output_tok_s"] for r in results) for name, results in runs.items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "Intel Xeon, 2 cores"
    result = {"machine": device, "cpu": platform.processor() or platform.machine(), "model": args.model,
              "num_requests": args.num_requests, "max_tokens": args.max_tokens, "constrained_share": 0.5,
              "best_output_tok_s": best, "mixed_vs_free": best["mixed"] / best["free"], "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    write_result(f"structured_output_{args.tag}.json", result)


if __name__ == "__main__":
    main()
