"""goodserve beside vLLM on the same card, the same shape and the same token ids, in one call.

Each engine runs in a process of its own (their CUDA contexts, allocators and compile caches never
meet), in the order --order gives ("gvvg": goodserve, vLLM, vLLM, goodserve, so drift over the call
spreads over both). The parts (--parts, default all), with their expected time on an H100 at the
defaults (per run: goodserve starts in 10-20 s, vLLM in ~70 s the first time, less once its compile
cache is warm):

  decode    batch 1, a 128-token prompt, 256 new tokens (greedy, ignore_eos): decode tok/s from the
            time of 256 tokens less the time of 1 (so the prefill and the request's overhead drop out,
            the same arithmetic for both engines), and TTFT as the time of the 1-token request (the
            best of 3 runs of one prompt: after the first, its KV is cached, so a hit's TTFT). ~5 s
  sharegpt  500 requests at once, ShareGPT-like lengths (gpu_engine.py's lognormal draws: inputs
            ~200, outputs ~180 tokens, clipped to 4..1024), ignore_eos: requests/s and output tok/s. ~15 s
  prefix    a 4,096-token system prompt shared by short questions (20 tokens), batch 1, one after
            another: TTFT of the first (a miss: nothing of it cached) and of the next 10 (hits: the
            system prompt's KV cached), over 3 system prompts of their own; TTFT as the time of a
            1-token request (how many tokens the answer then has does not change it). ~3 s
  long      one 32,768-token prompt, batch 1: TTFT (time of a 1-token request), 3 fresh prompts
            (a warm-up prompt first, so no kernel compiles inside a measured one). ~10 s
  online    each engine's OpenAI-compatible server at its defaults, `goodserve bench` as the client
            for both (peer_serving.py): Poisson arrivals of bench's ShareGPT-like workload, goodput
            capacity at TTFT <= 200 ms and TPOT <= 50 ms (the rate where SLO attainment crosses 90%;
            the search's first probe sends 200 prompts, later ones enough to reach a steady state),
            or with --online-rates a fixed ladder (each probe enough prompts for 30 s of arrivals at
            the ladder's highest rate). Its own order, --online-order (default "gv": one server
            each; "s": goodserve told the same targets, peer_serving.GOODSERVE_FLAGS). A search
            took 4.3 min for goodserve on an H100 (5 probes, its server up in ~40 s); vLLM's server
            takes ~100 s to start.

The in-process parts at --order gvvg take ~5 min (goodserve ~45 s a run, vLLM ~100 s); an online
search ~4-6 min an engine. On the GPU each goes in a call of its own, back to back on one warm
machine: --parts decode,sharegpt,prefix,long, then --parts online --online-order v, then g (and s).
--deadline-s (default 570) starts no run past it and stops the one in progress there: the JSON,
rewritten after every run, keeps what finished.

Both engines at their defaults, as their users get them; the settings each resolved are recorded
(vLLM: max_num_seqs, max_num_batched_tokens, CUDA graphs / compilation, attention backend, and the
lines of its log that name them). Weights: random ("dummy") of the llama-3.1-8b shape, bf16; vLLM
reads the shape from a config.json written here; offline prompts are token ids, the servers get text
in the synthetic tokenizer peer_model.py writes for both.

  PYTHONPATH=src python3 benchmarks/gpu_peer_vllm.py --order gvvg     (writes $OUT/gpu_peer_vllm.json)
  one engine alone: --engine goodserve|vllm --json FILE

vLLM's packages (/tmp/vsite, --vllm-site, from ../shared/peers/vllm-gpu.sh, with
peer_vllm_server_wheels.sh's added to its deps for the server) go on the path of vLLM's processes
only: goodserve's run with the packages goodserve installs with.

On the CPU, goodserve's side of every part at small sizes (vLLM's paths need vLLM and a GPU):

  PYTHONPATH=src:benchmarks python benchmarks/gpu_peer_vllm.py --engine goodserve --json /tmp/g.json \\
      --model dummy:tiny --device cpu --smoke --online-rates 4

The physical limit beside them: batch-1 decode at the measured copy bandwidth over the bytes a
token reads (weights + KV).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine import random_prompts, sharegpt_like_lengths  # noqa: E402
from peer_model import GOODSERVE_MODEL, LLAMA_31_8B_CONFIG, VLLM_ENGINE_ARGS, preset_of, vllm_model_dir  # noqa: E402
from peer_serving import OnlinePlan, engine_env, serve_and_bench  # noqa: E402
from peer_vllm_settings import settings_log, vllm_settings  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
IN_PROCESS_PARTS = ("decode", "sharegpt", "prefix", "long")
PARTS = (*IN_PROCESS_PARTS, "online")
ENGINES = {"g": "goodserve", "v": "vllm", "s": "goodserve-slo"}  # s: online only


@dataclass(frozen=True)
class Sizes:
    decode_prompt: int = 128
    decode_new_tokens: int = 256
    sharegpt_requests: int = 500
    sharegpt_max_len: int = 1024
    prefix_len: int = 4096
    question_len: int = 20
    prefix_rounds: int = 3  # system prompts, each a miss then its hits
    prefix_hits: int = 10
    long_len: int = 32768
    long_prompts: int = 3
    online_prompts: int = 200
    online_workload: tuple[str, ...] = ("--dataset-name", "sharegpt")
    # A ladder's probes (--online-rates) send enough prompts that arrivals at its highest rate last
    # this long: 200 at 30 req/s end before the load holds (the capacity search sizes its own probes).
    ladder_hold_s: float = 30.0


# Small enough for a tiny model on a CPU (dummy:tiny holds 1,024 positions).
SMOKE = Sizes(decode_prompt=16, decode_new_tokens=32, sharegpt_requests=16, sharegpt_max_len=128, prefix_len=256,
              question_len=8, prefix_rounds=2, prefix_hits=3, long_len=768, long_prompts=2, online_prompts=12,
              online_workload=("--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16"),
              ladder_hold_s=0.0)


class Prompts:
    """Random token ids, each call new ones (no engine finds one prompt's KV in another's cache)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.low, self.high = min(100, vocab_size // 4), min(20000, vocab_size)

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(self.low, self.high, n).tolist()


class GoodserveEngine:
    name = "goodserve"

    def __init__(self, model: str, device: str, **engine_args):
        from goodserve import LLM

        self.llm = LLM(model, device=device, **engine_args)
        self.vocab_size = preset_of(model).vocab_size

    def settings(self) -> dict:
        config = self.llm.engine.config
        return {key: str(getattr(config, key)) for key in (
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype", "enforce_eager",
            "async_scheduling", "enable_prefix_caching", "attention_backend") if hasattr(config, key)}

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        from goodserve import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [len(o.outputs[0].token_ids) for o in outputs]


class VllmEngine:
    name = "vllm"
    vocab_size = LLAMA_31_8B_CONFIG["vocab_size"]

    def __init__(self, model: str, device: str):  # its environment: peer_serving.engine_env
        from vllm import LLM

        self.llm = LLM(model=vllm_model_dir(), skip_tokenizer_init=True, **VLLM_ENGINE_ARGS)

    def settings(self) -> dict:
        return vllm_settings(self.llm.llm_engine.vllm_config)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(engine, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
    _sync()
    start = time.perf_counter()
    tokens = sum(engine.generate(prompts, max_tokens))
    _sync()
    return time.perf_counter() - start, tokens


def ttft_ms(engine, prompt: list[int]) -> float:
    """Batch 1: the time of a request for one token is its time to the first token."""
    return timed(engine, [prompt], [1])[0] * 1e3


def measure_decode(engine, prompts: Prompts, sizes: Sizes) -> dict:
    prompt, new = [prompts.ids(sizes.decode_prompt)], sizes.decode_new_tokens
    runs = []
    for _ in range(3):
        one_s, _ = timed(engine, prompt, [1])
        all_s, tokens = timed(engine, prompt, [new])
        assert tokens == new, tokens
        runs.append({"ttft_ms": one_s * 1e3, "decode_tok_s": (new - 1) / (all_s - one_s), "e2e_tok_s": new / all_s})
    return {"prompt_tokens": sizes.decode_prompt, "new_tokens": new, "runs": runs,
            "best_decode_tok_s": max(r["decode_tok_s"] for r in runs), "best_ttft_ms": min(r["ttft_ms"] for r in runs)}


def measure_sharegpt(engine, sizes: Sizes) -> dict:
    inputs, outputs = sharegpt_like_lengths(sizes.sharegpt_requests)
    inputs = [min(n, sizes.sharegpt_max_len) for n in inputs]
    outputs = [min(n, sizes.sharegpt_max_len) for n in outputs]
    prompts = [p["prompt_token_ids"] for p in random_prompts(inputs, vocab_size=engine.vocab_size)]
    engine.generate(prompts[:8], outputs[:8])  # warm-up
    seconds, tokens = timed(engine, prompts, outputs)
    assert tokens == sum(outputs), (tokens, sum(outputs))
    return {"requests": len(prompts), "seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "output_tok_s": tokens / seconds, "input_tokens": sum(map(len, prompts)), "output_tokens": tokens}


def measure_prefix(engine, prompts: Prompts, sizes: Sizes) -> dict:
    def round_of(system: list[int]) -> tuple[float, list[float]]:
        miss = ttft_ms(engine, system + prompts.ids(sizes.question_len))
        return miss, [ttft_ms(engine, system + prompts.ids(sizes.question_len)) for _ in range(sizes.prefix_hits)]

    round_of(prompts.ids(sizes.prefix_len))  # warm-up: this prompt length's kernels and the hit path
    rounds = [round_of(prompts.ids(sizes.prefix_len)) for _ in range(sizes.prefix_rounds)]
    misses, hits = [m for m, _ in rounds], [h for _, hs in rounds for h in hs]
    return {"system_prompt_tokens": sizes.prefix_len, "question_tokens": sizes.question_len,
            "miss_ttft_ms": misses, "hit_ttft_ms": hits, "median_miss_ttft_ms": float(np.median(misses)),
            "median_hit_ttft_ms": float(np.median(hits)), "miss_over_hit": float(np.median(misses) / np.median(hits))}


def measure_long(engine, prompts: Prompts, sizes: Sizes) -> dict:
    ttft_ms(engine, prompts.ids(sizes.long_len))  # warm-up
    runs = [ttft_ms(engine, prompts.ids(sizes.long_len)) for _ in range(sizes.long_prompts)]
    return {"prompt_tokens": sizes.long_len, "ttft_ms": runs, "median_ttft_ms": float(np.median(runs)),
            "prefill_tok_s": sizes.long_len / (float(np.median(runs)) / 1e3)}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def card_name() -> str:
    import torch

    return torch.cuda.get_device_name() if cuda_available() else platform.processor() or "cpu"


def measure(engine_name: str, parts: list[str], sizes: Sizes, model: str, device: str) -> dict:
    start = time.perf_counter()
    engine = {"goodserve": GoodserveEngine, "vllm": VllmEngine}[engine_name](model, device)
    result = {"engine": engine_name, "startup_s": time.perf_counter() - start, "settings": engine.settings(),
              "card": card_name()}
    prompts = Prompts(engine.vocab_size)
    engine.generate([prompts.ids(sizes.decode_prompt)], [16])  # warm-up
    measures = {"decode": lambda: measure_decode(engine, prompts, sizes),
                "sharegpt": lambda: measure_sharegpt(engine, sizes),
                "prefix": lambda: measure_prefix(engine, prompts, sizes),
                "long": lambda: measure_long(engine, prompts, sizes)}
    for part in parts:
        if part in measures:
            result[part] = measures[part]()
    return result


def decode_limit(sizes: Sizes) -> dict:
    """Batch-1 decode's bandwidth limit: weights + mean KV bytes a token, at the measured copy rate."""
    import torch
    from triton.testing import do_bench

    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    bandwidth = 2 * src.numel() * 4 / (ms * 1e-3)
    c = LLAMA_31_8B_CONFIG
    hidden, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    layer_params = hidden * (hidden + 2 * kv_dim) + hidden * hidden + 3 * hidden * inter
    read_bytes = 2 * (layers * layer_params + vocab * hidden + hidden)  # lm_head whole, one embedding row
    kv_bytes = 2 * 2 * layers * kv_dim * (sizes.decode_prompt + sizes.decode_new_tokens // 2)
    return {"copy_bandwidth_gbps": bandwidth / 1e9, "step_read_bytes": read_bytes + kv_bytes,
            "decode_limit_tok_s": bandwidth / (read_bytes + kv_bytes)}


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_in_process(name: str, index: int, args, deadline: Deadline) -> dict:
    """One engine's in-process parts in a child process; its log kept in $OUT."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    log_path = os.path.join(OUT, f"gpu_peer_vllm_{index}_{name}.log")
    command = [sys.executable, __file__, "--engine", name, "--json", out, "--parts",
               ",".join(p for p in args.parts if p in IN_PROCESS_PARTS), *passthrough_args(args)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=deadline.left(),
                                  env=engine_env(name, args.vllm_site)).returncode
        except subprocess.TimeoutExpired:
            code = "out of time (--deadline-s)"
    run = json.load(open(out)) if code == 0 else {"engine": name, "error": f"exit {code}"}
    run["wall_s"] = time.perf_counter() - start
    log_text = open(log_path, errors="replace").read()
    if name == "vllm":
        run["settings_log"] = settings_log(log_text)
    if "error" in run:
        run["log_tail"] = log_text[-3000:]
    return run


def online_plan(args) -> OnlinePlan:
    sizes = args.sizes
    if args.online_rates == "capacity":
        return OnlinePlan(list(sizes.online_workload), sizes.online_prompts, None, args.capacity_start_rate)
    rates = [float(r) for r in args.online_rates.split(",")]
    prompts = max(sizes.online_prompts, math.ceil(max(rates) * sizes.ladder_hold_s))
    return OnlinePlan(list(sizes.online_workload), prompts, rates)


def drive(args) -> None:
    os.makedirs(OUT, exist_ok=True)
    deadline = Deadline(args.deadline_s)
    in_process = [p for p in args.parts if p in IN_PROCESS_PARTS]
    report = {"parts": args.parts, "order": args.order if in_process else "",
              "online_order": args.online_order if "online" in args.parts else "",
              "sizes": dataclasses.asdict(args.sizes), "runs": [], "online": []}
    if "decode" in args.parts and cuda_available():
        report["limit"] = decode_limit(args.sizes)
    path = os.path.join(OUT, "gpu_peer_vllm.json")
    for index, letter in enumerate(args.order if in_process else ""):
        if deadline.left() <= 0:
            break
        run = run_in_process(ENGINES[letter], index, args, deadline)
        report["runs"].append(run)
        print(json.dumps({k: run.get(k) for k in ("engine", "wall_s", *in_process, "error")}), flush=True)
        json.dump(report, open(path, "w"), indent=2)
    for index, letter in enumerate(args.online_order if "online" in args.parts else ""):
        if deadline.left() <= 0:
            break
        start = time.perf_counter()
        run = serve_and_bench(ENGINES[letter], online_plan(args), OUT, f"online_{index}_{ENGINES[letter]}.json",
                              deadline.left(), args.model, args.device, args.vllm_site)
        run["wall_s"] = time.perf_counter() - start
        report["online"].append(run)
        print(json.dumps({k: run.get(k) for k in ("engine", "wall_s", "startup_s", "capacity_rate", "error")}),
              flush=True)
        json.dump(report, open(path, "w"), indent=2)
    report["summary"] = summarize(report)
    json.dump(report, open(path, "w"), indent=2)
    print(json.dumps(report["summary"], indent=1))


SUMMARY_KEYS = {  # summary key: (part, key in that part's result); lower is better for the *_ms ones
    "decode_tok_s": ("decode", "best_decode_tok_s"), "ttft_ms": ("decode", "best_ttft_ms"),
    "sharegpt_requests_per_s": ("sharegpt", "requests_per_s"), "sharegpt_output_tok_s": ("sharegpt", "output_tok_s"),
    "prefix_miss_ttft_ms": ("prefix", "median_miss_ttft_ms"), "prefix_hit_ttft_ms": ("prefix", "median_hit_ttft_ms"),
    "long_ttft_ms": ("long", "median_ttft_ms"), "online_capacity_req_s": ("online", "capacity_rate"),
}


def values_of(report: dict, engine: str, part: str, field: str) -> list[float]:
    if part == "online":
        return [r[field] for r in report["online"] if r["engine"] == engine and r.get(field) is not None]
    return [r[part][field] for r in report["runs"] if r["engine"] == engine and part in r]


def summarize(report: dict) -> dict:
    """Each engine's mean over its runs, and goodserve's advantage over vLLM (>1: goodserve better,
    whether the number is a rate or a time)."""
    summary = {}
    for name in ENGINES.values():
        numbers = {key: float(np.mean(values)) for key, (part, field) in SUMMARY_KEYS.items()
                   if (values := values_of(report, name, part, field))}
        if "decode_tok_s" in numbers and "limit" in report:
            numbers["decode_share_of_limit"] = numbers["decode_tok_s"] / report["limit"]["decode_limit_tok_s"]
        if numbers:
            summary[name] = numbers
    for name in ("goodserve", "goodserve-slo"):
        if name in summary and "vllm" in summary:
            g, v = summary[name], summary["vllm"]
            summary[f"{name}_advantage".replace("-", "_")] = {
                key: (v[key] / g[key] if key.endswith("_ms") else g[key] / v[key])
                for key in SUMMARY_KEYS if g.get(key) and v.get(key)}
    return summary


def passthrough_args(args) -> list[str]:
    return ["--model", args.model, "--device", args.device, "--vllm-site", args.vllm_site] + (
        ["--smoke"] if args.smoke else [])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--order", default="gvvg", help="in-process parts: g = goodserve, v = vLLM, a process each")
    parser.add_argument("--online-order", default="gv",
                        help="online part: a server each, in this order (s: goodserve with the SLO targets, "
                             "peer_serving.GOODSERVE_FLAGS)")
    parser.add_argument("--online-rates", default="capacity",
                        help="'capacity' (the goodput capacity search) or a comma list of request rates")
    parser.add_argument("--capacity-start-rate", type=float, default=16.0, help="the search's first probe, req/s")
    parser.add_argument("--deadline-s", type=float, default=570.0,
                        help="no run starts past this many seconds, and the one in progress stops there")
    parser.add_argument("--engine", choices=("goodserve", "vllm"), help="run one engine's parts in this process")
    parser.add_argument("--json", help="with --engine: where its result goes")
    parser.add_argument("--model", default=GOODSERVE_MODEL, help="goodserve's model (vLLM always runs llama-3.1-8b)")
    parser.add_argument("--device", default="cuda", help="goodserve's device")
    parser.add_argument("--vllm-site", default="/tmp/vsite",
                        help="vLLM's package folder: on the path of vLLM's processes only")
    parser.add_argument("--smoke", action="store_true", help="small sizes, for a tiny model on a CPU")
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    unknown = set(args.parts) - set(PARTS) or set(args.order) - {"g", "v"} or set(args.online_order) - set(ENGINES)
    if unknown:
        parser.error(f"unknown parts or engine letters: {', '.join(sorted(unknown))}")
    if args.engine and not args.json:
        parser.error("--engine needs --json FILE")
    args.sizes = SMOKE if args.smoke else Sizes()
    return args


def main() -> None:
    args = parse_args()
    if not args.engine:
        drive(args)
        return
    if args.engine == "vllm":  # as the driver runs it, also when started by hand
        os.environ.update(engine_env("vllm", args.vllm_site))
        sys.path.insert(0, args.vllm_site)
    result = {"engine": args.engine}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    if "online" in args.parts:  # first: its server is gone before this process loads the engine
        result["online"] = serve_and_bench(args.engine, online_plan(args), os.path.dirname(os.path.abspath(args.json)),
                                           f"online_{args.engine}.json", args.deadline_s, args.model, args.device,
                                           args.vllm_site)
    if any(p in IN_PROCESS_PARTS for p in args.parts):
        result.update(measure(args.engine, args.parts, args.sizes, args.model, args.device))
    json.dump(result, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
