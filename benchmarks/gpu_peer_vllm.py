"""goodserve beside vLLM on the same card, the same shape and the same token ids, in one call.

Each engine runs in a process of its own (their CUDA contexts, allocators and compile caches never
meet), in the order --order gives ("gvvg": goodserve, vLLM, vLLM, goodserve, so drift over the call
spreads over both), and each run measures:

  decode    batch 1, a 128-token prompt, 256 new tokens (greedy, ignore_eos): decode tok/s from the
            time of 256 tokens less the time of 1 (so the prefill and the request's overhead drop out,
            the same arithmetic for both engines), and TTFT as the time of the 1-token request
  sharegpt  500 requests at once, ShareGPT-like lengths (gpu_engine.py's lognormal draws: inputs
            ~200, outputs ~180 tokens, clipped to 4..1024), ignore_eos: requests/s and output tok/s

Both engines at their defaults, as their users get them; the settings each resolved are recorded
(vLLM: max_num_seqs, max_num_batched_tokens, CUDA graphs / compilation, attention backend).
Weights: random ("dummy") of the llama-3.1-8b shape, bf16; vLLM reads the shape from a config.json
written here and skips its tokenizer (prompts are token ids).

  PYTHONPATH=/tmp/vsite:src python3 benchmarks/gpu_peer_vllm.py --order gvvg     (writes $OUT/gpu_peer_vllm.json)
  one engine alone: --engine goodserve|vllm --json FILE

The physical limit beside them: batch-1 decode at the measured copy bandwidth over the bytes a
token reads (weights + KV).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine import random_prompts, sharegpt_like_lengths  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
DECODE_PROMPT_LEN, DECODE_NEW_TOKENS = 128, 256

# Llama-3.1-8B's shape, for vLLM's dummy loader (goodserve has it as the preset dummy:llama-3.1-8b).
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}


def workloads() -> dict:
    rng = np.random.default_rng(0)
    inputs, outputs = sharegpt_like_lengths(500)
    return {"decode_prompt": rng.integers(100, 20000, DECODE_PROMPT_LEN).tolist(),
            "sharegpt_prompts": [p["prompt_token_ids"] for p in random_prompts(inputs)],
            "sharegpt_outputs": outputs}


class GoodserveEngine:
    name = "goodserve"

    def __init__(self):
        from goodserve import LLM

        self.llm = LLM("dummy:llama-3.1-8b", device="cuda")

    def settings(self) -> dict:
        config = self.llm.engine.config
        return {key: str(getattr(config, key)) for key in (
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype", "enforce_eager",
            "async_scheduling", "enable_prefix_caching") if hasattr(config, key)}

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        from goodserve import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [len(o.outputs[0].token_ids) for o in outputs]


class VllmEngine:
    name = "vllm"

    def __init__(self):
        # FlashInfer is not carried: its top-k/top-p sampler (unused by greedy requests) is turned off,
        # since vLLM 0.26.0 imports FlashInfer unguarded when deciding whether to use it.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM

        self.model_dir = tempfile.mkdtemp(prefix="vllm-dummy-")
        with open(os.path.join(self.model_dir, "config.json"), "w") as f:
            json.dump(LLAMA_31_8B_CONFIG, f)
        self.llm = LLM(model=self.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")

    def settings(self) -> dict:
        import vllm

        config = self.llm.llm_engine.vllm_config
        scheduler, compilation = config.scheduler_config, config.compilation_config
        return {"version": vllm.__version__, "max_num_seqs": scheduler.max_num_seqs,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                "max_model_len": config.model_config.max_model_len,
                "enforce_eager": config.model_config.enforce_eager,
                "compilation": str(getattr(compilation, "mode", getattr(compilation, "level", None))),
                "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
                "attention_backend": os.environ.get("VLLM_ATTENTION_BACKEND") or _vllm_attention_backend(config),
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "gpu_memory_utilization": config.cache_config.gpu_memory_utilization}

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]


def _vllm_attention_backend(config) -> str | None:
    """The backend vLLM picked, read from its log-free state where this version keeps it."""
    try:
        from vllm.attention.selector import get_attn_backend

        model = config.model_config
        return get_attn_backend(model.get_head_size(), model.dtype, config.cache_config.cache_dtype,
                                config.cache_config.block_size).get_name()
    except Exception as exc:  # noqa: BLE001 - the selector's signature moves between releases
        return f"unknown ({type(exc).__name__})"


def timed(engine, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sum(engine.generate(prompts, max_tokens))
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def measure(engine_name: str) -> dict:
    import torch

    work = workloads()
    start = time.perf_counter()
    engine = {"goodserve": GoodserveEngine, "vllm": VllmEngine}[engine_name]()
    result = {"engine": engine_name, "startup_s": time.perf_counter() - start, "settings": engine.settings(),
              "card": torch.cuda.get_device_name()}
    prompt = [work["decode_prompt"]]
    engine.generate(prompt, [16])  # warm-up
    runs = []
    for _ in range(3):
        one_s, _ = timed(engine, prompt, [1])
        all_s, tokens = timed(engine, prompt, [DECODE_NEW_TOKENS])
        assert tokens == DECODE_NEW_TOKENS, tokens
        runs.append({"ttft_ms": one_s * 1e3, "decode_tok_s": (DECODE_NEW_TOKENS - 1) / (all_s - one_s),
                     "e2e_tok_s": DECODE_NEW_TOKENS / all_s})
    result["decode"] = {"runs": runs, "best_decode_tok_s": max(r["decode_tok_s"] for r in runs),
                        "best_ttft_ms": min(r["ttft_ms"] for r in runs)}
    prompts, outputs = work["sharegpt_prompts"], work["sharegpt_outputs"]
    engine.generate(prompts[:8], outputs[:8])  # warm-up
    seconds, tokens = timed(engine, prompts, outputs)
    assert tokens == sum(outputs), (tokens, sum(outputs))
    result["sharegpt"] = {"requests": len(prompts), "seconds": seconds, "requests_per_s": len(prompts) / seconds,
                          "output_tok_s": tokens / seconds,
                          "input_tokens": sum(map(len, prompts)), "output_tokens": tokens}
    return result


def decode_limit() -> dict:
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
    kv_bytes = 2 * 2 * layers * kv_dim * (DECODE_PROMPT_LEN + DECODE_NEW_TOKENS // 2)
    return {"copy_bandwidth_gbps": bandwidth / 1e9, "step_read_bytes": read_bytes + kv_bytes,
            "decode_limit_tok_s": bandwidth / (read_bytes + kv_bytes)}


def drive(order: str) -> None:
    os.makedirs(OUT, exist_ok=True)
    report = {"order": order, "runs": [], "limit": decode_limit()}
    path = os.path.join(OUT, "gpu_peer_vllm.json")
    for letter in order:
        name = {"g": "goodserve", "v": "vllm"}[letter]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--engine", name, "--json", out])
        run = json.load(open(out)) if proc.returncode == 0 else {"engine": name, "error": f"exit {proc.returncode}"}
        run["wall_s"] = time.perf_counter() - start
        report["runs"].append(run)
        print(json.dumps({k: run.get(k) for k in ("engine", "wall_s", "decode", "sharegpt", "error")}), flush=True)
        json.dump(report, open(path, "w"), indent=2)
    report["summary"] = summarize(report["runs"], report["limit"])
    json.dump(report, open(path, "w"), indent=2)
    print(json.dumps(report["summary"], indent=1))


def summarize(runs: list[dict], limit: dict) -> dict:
    """Each engine's mean over its runs, and goodserve's ratio to vLLM."""
    summary = {}
    for name in ("goodserve", "vllm"):
        ok = [r for r in runs if r["engine"] == name and "error" not in r]
        if ok:
            summary[name] = {
                "decode_tok_s": float(np.mean([r["decode"]["best_decode_tok_s"] for r in ok])),
                "ttft_ms": float(np.mean([r["decode"]["best_ttft_ms"] for r in ok])),
                "sharegpt_requests_per_s": float(np.mean([r["sharegpt"]["requests_per_s"] for r in ok])),
                "sharegpt_output_tok_s": float(np.mean([r["sharegpt"]["output_tok_s"] for r in ok]))}
    if len(summary) == 2:
        g, v = summary["goodserve"], summary["vllm"]
        summary["goodserve_over_vllm"] = {key: g[key] / v[key] for key in g if key != "ttft_ms"}
    for name, numbers in summary.items():
        if "decode_tok_s" in numbers:
            numbers["decode_share_of_limit"] = numbers["decode_tok_s"] / limit["decode_limit_tok_s"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--order", default="gvvg", help="g = goodserve, v = vLLM, one process each, in this order")
    parser.add_argument("--engine", choices=("goodserve", "vllm"), help="run one engine in this process")
    parser.add_argument("--json", help="with --engine: where its result goes")
    args = parser.parse_args()
    if args.engine:
        result = measure(args.engine)
        json.dump(result, open(args.json, "w"), indent=2)
    else:
        drive(args.order)


if __name__ == "__main__":
    main()
