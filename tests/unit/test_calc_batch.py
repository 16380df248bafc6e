"""`goodserve calc batch`: an offline batch's floor time against hand computations and brute-force loops."""

import json

import numpy as np
import pytest

from goodserve.bench.text import PromptText
from goodserve.bench.workloads import WorkloadConfig, build_workload, offline_sharegpt_lengths
from goodserve.cli import main
from goodserve.diagnose.batch_bound import batch_bound
from goodserve.model.presets import get_preset
from goodserve.model.spec import ModelSpec

# 2 layers, hidden 4, 2 query heads and 1 KV head of 2, MLP 8, vocabulary 10, lm_head not tied.
TINY = ModelSpec(name="hand", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                 num_kv_heads=1, head_dim=2, max_position_embeddings=64)
# Request A: 3 prompt tokens, 2 output tokens; B: 1 prompt token, 4 output tokens.
REQUESTS = [(3, 2), (1, 4)]


def test_two_requests_on_a_tiny_shape_by_hand():
    """Per layer: q, k, v, o = 4x4 + 4x2 + 4x2 + 4x4 = 48 weights, gate, up, down = 3 x 4 x 8 = 96, two
    norms of 4: 152; 2 layers 304, the final norm 4, the lm_head 40 (the embedding's 40 are not read).
    bf16: a step reads (304 + 4 + 40) x 2 = 696 B; B's 4 outputs take 4 steps: 2,784 B.
    K/V: 2 x 2 layers x 1 head x 2 x 2 B = 16 B a token. A's one decode (its output 1, at position 4)
    reads 4 tokens; B's decodes (positions 2, 3, 4) read 2 + 3 + 4 = 9: 13 x 16 = 208 B. Tokens fed:
    A 3 + 1, B 1 + 3 = 8, each writes its K/V: 128 B. Bytes: 3,120.
    FLOPs: 8 tokens through the 308 weights before the lm_head: 2 x 308 x 8 = 4,928; 6 tokens sampled
    through the lm_head: 2 x 40 x 6 = 480. Attention: each request's tokens at positions 1..4 see
    1 + 2 + 3 + 4 = 10 keys a layer: 40 (query, key) pairs, each 4 x q_size (4) = 16 FLOPs: 640. FLOPs: 6,048."""
    compute_bound = batch_bound(TINY, REQUESTS, bandwidth=1000.0, flops_rate=1000.0)
    assert compute_bound.steps == 4
    assert compute_bound.weight_bytes_per_step == 696
    assert compute_bound.weight_bytes == 2784
    assert compute_bound.kv_token_reads == 13 and compute_bound.kv_read_bytes == 208
    assert compute_bound.kv_write_bytes == 128
    assert compute_bound.bytes == 3120
    assert compute_bound.matmul_flops == 5408 and compute_bound.attention_flops == 640
    assert compute_bound.flops == 6048
    assert compute_bound.binds == "compute" and compute_bound.seconds == pytest.approx(6.048)
    assert compute_bound.requests_per_s == pytest.approx(2 / 6.048)
    assert compute_bound.output_tokens_per_s == pytest.approx(6 / 6.048)
    # Ten times the matmul rate: 0.6048 s of FLOPs, so the 3.12 s of bytes bind.
    bandwidth_bound = batch_bound(TINY, REQUESTS, bandwidth=1000.0, flops_rate=10_000.0)
    assert bandwidth_bound.binds == "bandwidth" and bandwidth_bound.seconds == pytest.approx(3.12)
    assert bandwidth_bound.requests_per_s == pytest.approx(2 / 3.12)


def test_a_sliding_window_layer_reads_and_attends_its_window_only():
    """Layer 0 keeps 2 keys, layer 1 all. Per layer a position's K/V is 8 B. A's decode at position 4
    reads 2 + 4; B's at 2, 3, 4 read (2 + 2 + 2) + (2 + 3 + 4): 21 positions, 168 B. Attention: each
    request's positions 1..4 see 1 + 2 + 2 + 2 = 7 keys in layer 0 and 10 in layer 1: 34 pairs, 544 FLOPs.
    At its end each request holds 2 + 4 positions: 96 B."""
    windowed = ModelSpec(**{**TINY.__dict__, "layer_windows": (2, None)})
    bound = batch_bound(windowed, REQUESTS, bandwidth=1.0, flops_rate=1.0)
    assert bound.kv_read_bytes == 168 and bound.attention_flops == 544
    assert bound.kv_held_bytes == 96
    assert bound.kv_write_bytes == 128  # every layer writes each token's K/V, windowed or not


def test_a_mixture_of_experts_reads_the_experts_its_steps_route_to():
    """1 layer, 4 experts of 3 x 4 x 8 = 96 weights, 2 routed a token. With every request started at once
    the steps feed 4 (the prompts), 2, 1 and 1 tokens; uniform routing reads 4 (1 - (1/2)^b) distinct
    experts of b tokens: 3.75 + 3 + 2 + 2 = 10.75 experts, x 192 B. The rest a step reads: attention 48,
    router 4 x 4, two norms 8, final norm 4, lm_head 40 = 116 weights, 232 B."""
    moe = ModelSpec(name="hand-moe", vocab_size=10, hidden_size=4, intermediate_size=0, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=8)
    bound = batch_bound(moe, REQUESTS, bandwidth=1.0, flops_rate=1.0)
    assert bound.weight_bytes == pytest.approx(4 * 232 + 10.75 * 192)


def test_windows_and_contexts_against_brute_force_loops():
    """Every token fed and every layer, one at a time, on Gemma-3's shape (5 of 6 layers windowed)."""
    spec = get_preset("gemma-3-12b")
    rng = np.random.default_rng(0)
    lengths = [(int(p), int(o)) for p, o in zip(rng.integers(1, 1500, 6), rng.integers(1, 900, 6))]
    pairs = reads = 0
    for p, o in lengths:
        for position in range(1, p + o):  # the last output token is sampled, never fed
            for layer in range(spec.num_layers):
                window = spec.layer_windows[layer]
                seen = position if window is None else min(position, window)
                pairs += seen
                reads += seen if position > p else 0
    bound = batch_bound(spec, lengths, bandwidth=1.0, flops_rate=1.0, kv_dtype="bf16")
    per_position = 2 * spec.num_kv_heads * spec.head_dim * 2
    assert bound.kv_read_bytes == reads * per_position
    assert bound.attention_flops == 4 * spec.q_size * pairs


def run_json(capsys, *argv) -> dict:
    assert main(["calc", "batch", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_engine_benchmarks_offline_batch_on_an_h100(capsys):
    """The 500 requests of benchmarks/gpu_engine.py's offline run (99,760 prompt and 89,752 output
    tokens, its longest answer 1,024) at a measured 3.0 TB/s copy rate and 744 TFLOP/s: Llama-3.1-8B reads
    (8,030,261,248 - 525,336,576 embedding) x 2 B = 15,009,849,344 B a step, and 128 KiB of K/V a token."""
    got = run_json(capsys, "--model", "llama-3.1-8b", "--workload", "sharegpt-offline", "--num-prompts", "500",
                   "--bandwidth-gbps", "3000", "--tflops", "744")
    assert (got["requests"], got["prompt_tokens"], got["output_tokens"], got["steps"]) == (500, 99_760, 89_752, 1024)
    inputs, outputs = offline_sharegpt_lengths(500)
    token_reads = sum((o - 1) * p + o * (o - 1) // 2 for p, o in zip(inputs, outputs))
    fed = 99_760 + 89_752 - 500
    expected_bytes = 1024 * 15_009_849_344 + (token_reads + fed) * 131_072
    assert got["bytes"] == pytest.approx(expected_bytes)
    assert got["bytes_seconds"] == pytest.approx(expected_bytes / 3e12)
    assert got["binds"] == "bandwidth" and got["requests_per_s"] == pytest.approx(500 / (expected_bytes / 3e12))


def test_lengths_are_bench_s_for_the_same_flags_and_seed(capsys):
    """The bound's token counts are those of the requests `goodserve bench` builds from the same flags."""
    def expected(**flags):
        requests = build_workload(WorkloadConfig(num_prompts=40, seed=7, **flags), PromptText(None, seed=7))
        return sum(r.prompt_len for r in requests), sum(r.output_len for r in requests)

    got = run_json(capsys, "--model", "llama-3.2-1b", "--workload", "sharegpt", "--num-prompts", "40", "--seed", "7",
                   "--tflops", "1")
    assert (got["prompt_tokens"], got["output_tokens"]) == expected(dataset_name="sharegpt")
    got = run_json(capsys, "--model", "llama-3.2-1b", "--num-prompts", "40", "--seed", "7", "--random-input-len", "300",
                   "--output-len", "50", "--random-range-ratio", "0.5", "--random-length-dist", "normal")
    assert (got["prompt_tokens"], got["output_tokens"]) == expected(
        random_input_len=300, random_output_len=50, random_range_ratio=0.5, random_length_dist="normal")
    got = run_json(capsys, "--model", "tiny", "--num-prompts", "3", "--prompt-len", "10", "--output-len", "5")
    assert (got["prompt_tokens"], got["output_tokens"], got["steps"]) == (30, 15, 5)


def test_the_bound_that_binds_follows_the_rates(capsys):
    fixed = ("--model", "llama-3.1-8b", "--prompt-len", "1000", "--output-len", "200", "--num-prompts", "256")
    default = run_json(capsys, *fixed)
    assert default["bandwidth"] == 3.35e12 and default["flops_rate"] == pytest.approx(989.4e12)  # h100-sxm's
    assert run_json(capsys, *fixed, "--tflops", "10")["binds"] == "compute"
    assert run_json(capsys, *fixed, "--bandwidth-gbps", "10")["binds"] == "bandwidth"


def test_prints_a_table_with_the_floor(capsys):
    assert main(["calc", "batch", "--model", "tiny", "--prompt-len", "4", "--output-len", "3", "--num-prompts",
                 "2"]) == 0
    out = capsys.readouterr().out
    assert "weight reads" in out and "KV reads" in out and "<- binds" in out
    assert "req/s" in out and "a ceiling no engine reaches" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny", "--gpu", "tpu-v9"], "unknown hardware"),
    (["--model", "tiny", "--bandwidth-gbps", "0"], "--bandwidth-gbps must be positive"),
    (["--model", "tiny", "--tflops", "-5"], "--tflops must be positive"),
    (["--model", "tiny", "--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--model", "tiny", "--output-len", "0"], "--random-output-len must be at least 1"),
    (["--model", "tiny", "--workload", "sharegpt", "--sharegpt-output-len", "0"], "--sharegpt-output-len must be"),
    (["--model", "tiny", "--workload", "sharegpt", "--output-len", "100"], "--random-output-len set --dataset-name "
                                                                            "random's lengths"),
    (["--model", "tiny", "--sharegpt-output-len", "100"], "not random's"),
    (["--model", "tiny", "--prompt-len", "1000", "--output-len", "100"], "passes tiny's context of 1024"),
    (["--model", "tiny", "--random-length-dist", "normal", "--random-range-ratio", "-1"], "must not be negative"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(["calc", "batch", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and captured.out == ""


def test_an_unknown_dataset_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["calc", "batch", "--model", "tiny", "--workload", "custom"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_hugging_face_directory_gives_the_bound_of_its_shape(tmp_path, capsys):
    """A config.json of the `tiny` preset's shape gives the preset's numbers."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False).save_pretrained(tmp_path)
    flags = ("--prompt-len", "100", "--output-len", "20", "--num-prompts", "3")
    from_directory = run_json(capsys, "--model", str(tmp_path), *flags)
    from_preset = run_json(capsys, "--model", "tiny", *flags)
    assert from_directory["bytes"] == from_preset["bytes"] > 0
    assert from_directory["flops"] == from_preset["flops"] > 0
