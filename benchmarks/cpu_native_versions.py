"""The native CPU kernels of several commits side by side, on this machine, in one run.

For each commit, `git archive` of its src/ into a temporary directory, then a child process on that
tree (its own native library, built on first use) times, alternating versions round by round:
- the kernels alone on the embedded model's shapes (smollm2-135m: 30 layers of int4 linears, group
  32, float16 scales; the Q8_0 lm_head; decode attention, 9 query / 3 KV heads of 64), random
  weights, 2 threads, min over repeats, each checked against a float64 torch reference;
- single-stream decode of the embedded model with the CPU default (gguf codes): 128 greedy tokens,
  decode tok/s = 127 / (time for 128 tokens - time for 1), and the token ids (they must agree).

    PYTHONPATH=src python benchmarks/cpu_native_versions.py 969afa0 fc98200 HEAD   # $OUT/cpu_native_versions.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = os.environ.get("OUT", str(REPO / "benchmarks" / "results"))
PROMPT = "Write a short story about a robot who learns to paint."
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def time_min(fn, calls: int, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def kernel_times() -> dict:
    """Milliseconds a decode step spends in each kernel family at this version (and max relative errors)."""
    import torch

    from goodserve.native.build import library
    from goodserve.native.int4_gemv import Int4Layout
    from goodserve.native.q8_gemv import Q8Layout

    torch.manual_seed(0)
    lib, out = library(), {}
    layers = []
    for n, k in LAYER_SHAPES:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        scales = (torch.rand(n, k // 32) * 0.02).half().float()
        zeros = (-torch.rand(n, k // 32) * 0.1).half().float()
        codes = torch.stack([q & 15, q >> 4], -1).view(n, k).float()
        weight = (codes.view(n, k // 32, 32) * scales[..., None] + zeros[..., None]).view(n, k)
        layers.append((Int4Layout.from_codes(q, scales, zeros, 32), weight))
    errors = []
    for rows in (1, 4):
        xs = {k: torch.randn(rows, k) for _, k in LAYER_SHAPES}
        for layout, weight in layers:
            x = xs[layout.in_features]
            ref = (x.double() @ weight.double().T).float()
            errors.append(((layout.matmul(x) - ref).abs().max() / ref.abs().max()).item())
        out[f"int4_layers_ms_m{rows}"] = LAYERS * 1e3 * time_min(
            lambda: [layout.matmul(xs[layout.in_features]) for layout, _ in layers], 20)
    out["int4_max_rel_error"] = max(errors)
    codes8 = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8)
    scales8 = (torch.rand(VOCAB, HIDDEN // 32) * 0.01).half().float()
    head = Q8Layout.from_codes(codes8, scales8)
    x = torch.randn(1, HIDDEN)
    ref = (x.double() @ (codes8.float().view(VOCAB, -1, 32) * scales8[..., None]).view(VOCAB, HIDDEN).double().T).float()
    out["q8_lm_head_max_rel_error"] = ((head.matmul(x) - ref).abs().max() / ref.abs().max()).item()
    out["q8_lm_head_ms_m1"] = 1e3 * time_min(lambda: head.matmul(x), 10)
    out.update(attention_times(lib))
    return out


def attention_times(lib) -> dict:
    import torch

    q_heads, kv_heads, dim, block = 9, 3, 64, 16
    out = {}
    for length in (75, 140):
        blocks = -(-length // block)
        k_cache, v_cache = torch.randn(2 * blocks, block, kv_heads, dim), torch.randn(2 * blocks, block, kv_heads, dim)
        tables = (torch.arange(blocks, dtype=torch.int32) * 2).view(1, -1)
        lens, q, result = torch.tensor([length], dtype=torch.int32), torch.randn(1, q_heads, dim), torch.empty(1, q_heads, dim)
        slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in tables[0].tolist()])[:length]
        keys = k_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(q_heads // kv_heads, 1)
        values = v_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(q_heads // kv_heads, 1)
        weights = (torch.einsum("hd,lhd->hl", q[0].double(), keys.double()) / dim ** 0.5).softmax(-1)
        ref = torch.einsum("hl,lhd->hd", weights, values.double()).float()

        def call():
            lib.gs_decode_attention(q.data_ptr(), q_heads * dim, k_cache.data_ptr(), v_cache.data_ptr(),
                                    tables.data_ptr(), tables.stride(0), 1, lens.data_ptr(), result.data_ptr(), 1,
                                    q_heads, kv_heads, dim, block, dim ** -0.5, 2)
        call()
        out[f"attention_max_abs_error_len{length}"] = (result[0] - ref).abs().max().item()
        out[f"attention_ms_len{length}_x30"] = LAYERS * 1e3 * time_min(call, 200)
    return out


def decode() -> dict:
    from goodserve import LLM, SamplingParams

    llm = LLM()  # the embedded model; the CPU default (gguf codes)
    def generate(tokens: int):
        start = time.perf_counter()
        result = llm.generate([PROMPT], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start, result[0].outputs[0].token_ids
    generate(128)
    first = min(generate(1)[0] for _ in range(3))
    runs = [generate(128) for _ in range(3)]
    return {"decode_tok_s": 127 / (min(t for t, _ in runs) - first), "token_ids": runs[0][1]}


def child() -> None:
    import torch

    torch.set_num_threads(2)
    print(json.dumps({"kernels": kernel_times(), **decode()}))


def run_version(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    return {"model_name": name, "cores": os.cpu_count(), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commits", nargs="*")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()
    rounds: dict[str, list[dict]] = {c: [] for c in args.commits}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for commit in args.commits:
            trees[commit] = Path(tmp) / commit
            trees[commit].mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(trees[commit])], input=archive.stdout, check=True)
        for _ in range(args.rounds):
            for commit in args.commits:
                rounds[commit].append(run_version(trees[commit]))
                print(commit, round(rounds[commit][-1]["decode_tok_s"], 1), flush=True)
    summary = {}
    for commit, runs in rounds.items():
        kernels = {key: statistics.median(r["kernels"][key] for r in runs) for key in runs[0]["kernels"]}
        summary[commit] = {"decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
                           "decode_tok_s_runs": [r["decode_tok_s"] for r in runs], "kernels_median": kernels,
                           "token_ids": runs[0]["token_ids"]}
    first = summary[args.commits[0]]["token_ids"]
    result = {"machine": machine(), "threads": 2, "rounds": args.rounds, "prompt": PROMPT, "versions": summary,
              "same_tokens_as_first": {c: s["token_ids"] == first for c, s in summary.items()}}
    Path(OUT).mkdir(parents=True, exist_ok=True)
    path = Path(OUT) / "cpu_native_versions.json"
    path.write_text(json.dumps(result, indent=1))
    for commit, s in summary.items():
        print(commit, f"{s['decode_tok_s_median']:.1f} tok/s", {k: round(v, 3) for k, v in s["kernels_median"].items()})
    print("wrote", path)


if __name__ == "__main__":
    main()
