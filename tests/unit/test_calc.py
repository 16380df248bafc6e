"""Calculators against worked examples computed by hand."""

import argparse
import dataclasses

import pytest

from goodserve.diagnose import calc_command
from goodserve.diagnose.calc import (cost_per_million_tokens, decode_weight_bytes, fit, kv_cache_bytes,
                                     max_concurrent_sequences, weight_bytes)
from goodserve.diagnose.parallel import (Layout, advise_layout, allreduce_payload_bytes, decode_limit,
                                         decode_tokens_per_s, handoff_bytes, layout_fit, micro_batch_advice,
                                         ring_bytes_sent)
from goodserve.diagnose.roofline import mbu
from goodserve.errors import InvalidRequestError
from goodserve.hardware import Hardware, get_hardware
from goodserve.model.presets import get_preset
from goodserve.model.spec import ModelSpec


def llama2_13b_shape():
    # 40 layers, 5120 hidden, 40 heads of 128, MHA: exactly what the worked example states.
    return ModelSpec(name="llama-2-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                     num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128, max_position_embeddings=4096)


def test_llama2_13b_kv_at_batch_32_x_2048_fp16_is_53_7_gb():
    kv = kv_cache_bytes(llama2_13b_shape(), tokens=2048, batch=32, kv_dtype="fp16")
    assert kv == 2 * 40 * 40 * 128 * 2 * 2048 * 32
    assert round(kv / 1e9, 1) == 53.7
    assert kv_cache_bytes(get_preset("llama-2-13b"), 2048, 32, "fp16") == kv  # the preset agrees


def test_llama31_8b_gqa_kv():
    spec = get_preset("llama-3.1-8b")
    # 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token: 4x less than 32-head MHA.
    assert kv_cache_bytes(spec, 1, 1, "bf16") == 131072
    assert kv_cache_bytes(spec, 8192, 1, "bf16") / 2**30 == pytest.approx(1.0)  # 1 GiB per 8K sequence
    assert kv_cache_bytes(spec, 8192, 1, "int8") == kv_cache_bytes(spec, 8192, 1, "bf16") / 2
    # 40 GB of KV budget holds floor(40e9 / 1 GiB) = 37 such sequences.
    assert max_concurrent_sequences(spec, 40e9, 8192, "bf16") == 37


def test_mbu_of_7b_fp16_at_100_tok_s_on_2_tb_s_is_70_percent():
    bytes_per_token = 7e9 * 2  # batch 1: every token reads all 14 GB of weights
    assert mbu(bytes_per_token, 100.0, 2e12) == pytest.approx(0.70)


def test_a_decode_step_reads_a_row_of_an_untied_embedding_table_and_a_tied_one_whole():
    """2 layers of hidden 64: q and o 64 x 64, k and v 64 x 32, the MLP 3 x 64 x 128, 2 norms of 64; a
    final norm of 64; a 1000 x 64 table. Untied, the lm_head is a second 1000 x 64 matrix: a step reads it
    whole and of the table one row a token (left out). Tied, the lm_head is the table, read once."""
    untied = ModelSpec(name="untied", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    tied = dataclasses.replace(untied, name="tied", tie_word_embeddings=True)
    body = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert weight_bytes(untied) == (body + 2 * 1000 * 64) * 2  # what memory holds: the table and the lm_head
    assert decode_weight_bytes(untied) == (body + 1000 * 64) * 2  # the lm_head, not the table
    assert weight_bytes(tied) == decode_weight_bytes(tied) == (body + 1000 * 64) * 2  # the table, once
    assert decode_weight_bytes(untied, batch=64) == decode_weight_bytes(untied)  # the same bytes at any batch
    # int4 quantizes the matmuls (the lm_head too: 0.5 B and a bf16 scale per 128) and keeps the table in
    # bf16: it is the table's 2 bytes a weight that a step leaves unread
    matmuls = body + 1000 * 64
    assert decode_weight_bytes(untied, "int4") == matmuls * 0.5 + matmuls / 128 * 2
    # the embedded SmolLM2-135M ties its embeddings: a step reads all its 134.5 M bf16 parameters
    assert decode_weight_bytes(get_preset("smollm2-135m")) == 134_515_008 * 2


def test_fit_at_tensor_parallel_degrees():
    spec = get_preset("llama-3.1-70b")
    weights = weight_bytes(spec, "bf16")
    assert weights / 1e9 == pytest.approx(141.1, abs=0.1)  # 70.55 B params x 2 bytes
    one = fit(spec, 80e9, tp=1, seq_len=8192, batch=1)
    assert not one.weights_fit and not one.fits
    four = fit(spec, 80e9, tp=4, seq_len=8192, batch=16)
    assert four.weight_bytes_per_gpu == pytest.approx(weights / 4)
    # 8 KV heads over 4 GPUs: 2 heads each -> 2 x 80 x 2 x 128 x 2 B = 81920 B per token per GPU.
    assert four.kv_bytes_per_gpu == pytest.approx(81920 * 8192 * 16)
    assert four.fits
    usable = 80e9 * 0.9 - 1e9
    assert four.max_sequences == int((usable - weights / 4) // (81920 * 8192))
    # 16 GPUs > 8 KV heads: each GPU keeps one head's copy, not half of one.
    sixteen = fit(spec, 80e9, tp=16, seq_len=1, batch=1)
    assert sixteen.kv_bytes_per_gpu == 2 * 80 * 1 * 128 * 2
    with pytest.raises(InvalidRequestError):
        fit(spec, 80e9, tp=3)


def test_int4_weights_count_group_scales():
    spec = get_preset("llama-2-7b")
    embed = spec.vocab_size * spec.hidden_size
    matmul = spec.num_params() - embed
    assert weight_bytes(spec, "int4") == pytest.approx(embed * 2 + matmul * 0.5 + matmul / 128 * 2)


def test_cost_per_million_tokens():
    # $2/h for 1000 tok/s: 3.6M tokens per hour -> $0.5556 per 1M.
    assert cost_per_million_tokens(2.0, 1000.0) == pytest.approx(2.0 / 3.6)
    assert cost_per_million_tokens(2.0, 1000.0, num_gpus=8) == pytest.approx(8 * 2.0 / 3.6)
    with pytest.raises(InvalidRequestError):
        cost_per_million_tokens(2.0, 0.0)


def run_calc(*argv):
    parser = argparse.ArgumentParser()
    calc_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calc", *argv])
    return args.func(args)


def test_calc_command_kv_from_shape(capsys):
    assert run_calc("kv", "--num-layers", "40", "--hidden-size", "5120", "--num-heads", "40",
                    "--batch", "32", "--seq-len", "2048", "--kv-dtype", "fp16") == 0
    assert "53.7 GB" in capsys.readouterr().out


def test_calc_command_fit_and_cost(capsys):
    assert run_calc("fit", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--tp", "1") == 1
    assert "does not fit" in capsys.readouterr().out
    assert run_calc("fit", "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "1") == 0
    assert run_calc("cost", "--gpu-hourly-cost", "2", "--tokens-per-s", "1000") == 0
    assert "$0.5556 per 1M tokens" in capsys.readouterr().out


def test_calc_cost_prices_batch_tokens_beside_online(capsys):
    """$2/h: online at 1000 tok/s, 3.6M tokens an hour, $0.5556 per 1M; batch at 4500 tok/s, 16.2M
    an hour, $0.1235 per 1M, 4.5x cheaper. On 2 GPUs each costs twice as much."""
    assert run_calc("cost", "--gpu-hourly-cost", "2", "--tokens-per-s", "1000", "--batch-tokens-per-s", "4500") == 0
    out = capsys.readouterr().out
    assert "online: $0.5556 per 1M tokens at 1000 tok/s" in out
    assert "batch:  $0.1235 per 1M tokens at 4500 tok/s (4.50x cheaper than online)" in out
    assert run_calc("cost", "--gpu-hourly-cost", "2", "--tokens-per-s", "1000", "--batch-tokens-per-s", "4500",
                    "--num-gpus", "2") == 0
    out = capsys.readouterr().out
    assert "$1.1111" in out and "$0.2469" in out and "4.50x" in out


def test_calc_command_bad_input():
    with pytest.raises(InvalidRequestError, match="give --model"):
        run_calc("kv", "--num-layers", "40")
    from goodserve.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="unknown model"):
        run_calc("kv", "--model", "no-such-model")


# Parallel layouts (diagnose/parallel.py), against hand-computed values.

def test_pipeline_stages_split_weights_and_layers_and_replicas_split_the_batch():
    spec = get_preset("llama-3.1-70b")
    weights = 70_553_706_496 * 2
    two_by_two = layout_fit(spec, Layout(tp=2, pp=2), 80e9, 8192, 1, "bf16", "bf16", 0.9)
    assert two_by_two.weight_bytes_per_gpu == weights / 4
    # 40 layers per stage x 4 of 8 KV heads x 128 x 2 K/V x 2 bytes = 81920 B per token per GPU
    assert two_by_two.kv_bytes_per_gpu == 2 * 40 * 4 * 128 * 2 * 8192
    # 80 layers over 3 stages: the first stages hold 27
    assert layout_fit(spec, Layout(tp=8, pp=3), 80e9, 1, 1, "bf16", "bf16", 0.9).kv_bytes_per_gpu == 2 * 27 * 1 * 128 * 2
    # 2 replicas of llama-3.1-8b: 32 sequences of 1024 become 16 per GPU, 128 KiB per token each
    dp = layout_fit(get_preset("llama-3.1-8b"), Layout(dp=2), 80e9, 1024, 32, "bf16", "bf16", 0.9)
    assert dp.kv_bytes_per_gpu == 16 * 1024 * 131072
    with pytest.raises(InvalidRequestError, match="must divide 64 heads"):
        layout_fit(spec, Layout(tp=3), 80e9, 1, 1, "bf16", "bf16", 0.9)


def test_allreduce_bytes_per_step():
    small, big = get_preset("llama-3.1-8b"), get_preset("llama-3.1-70b")
    # 2 all-reduces x 32 layers x 4096 hidden x 1 token x 2 bytes; a ring of 2 sends 2 (2 - 1) / 2 = all of it
    assert allreduce_payload_bytes(small, 2, 1, 1) == 524_288
    assert ring_bytes_sent(524_288, 2) == 524_288
    # 70B at TP 4: 2 x 80 x 8192 x 2 = 2.62 MB, of which a ring sends 2 x 3 / 4 = 1.5x per GPU
    assert allreduce_payload_bytes(big, 4, 1, 1) == 2_621_440
    assert ring_bytes_sent(2_621_440, 4) == 3_932_160
    assert allreduce_payload_bytes(big, 4, 2, 16) == 2 * 40 * 8192 * 16 * 2  # a stage all-reduces its layers
    assert allreduce_payload_bytes(big, 1, 1, 16) == 0


def test_decode_limit_with_tensor_parallelism():
    spec, h100 = get_preset("llama-3.1-8b"), get_hardware("h100-sxm")
    # a step reads 8.03 B parameters less the 128256 x 4096 embedding table (a token reads one row), in bf16,
    # at the 3.0 TB/s a copy reaches on an H100 (of the datasheet's 3.35)
    read = (8_030_261_248 - 128_256 * 4096) * 2  # 15.01 GB
    one = decode_limit(spec, h100, Layout())
    assert one.read_s == pytest.approx(read / 3.0e12)  # 5.00 ms: 200 tok/s by bandwidth
    assert one.layers_s == pytest.approx(32 * 24.6e-6)  # each layer's kernel latencies, at any TP
    assert one.token_s == pytest.approx(read / 3.0e12 + 32 * 24.6e-6)  # 5.79 ms: 173 tok/s
    two = decode_limit(spec, h100, Layout(tp=2))
    assert two.read_s == pytest.approx(read / 2 / 3.0e12)  # half the weights per GPU
    assert two.layers_s == one.layers_s
    # 64 all-reduces of 8.5 us (what each cost a step, measured), and 0.5 MB over a 450 GB/s link
    assert two.allreduce_s == pytest.approx(64 * 8.5e-6 + 524_288 / 450e9)
    # (2.50 + 0.79 + 0.54 ms against 5.79): 1.51x, where the bytes alone would give 2x
    assert two.tokens_per_s / one.tokens_per_s == pytest.approx(1.51, abs=0.01)
    assert two.bandwidth_tokens_per_s / one.bandwidth_tokens_per_s == pytest.approx(2.0)
    free = decode_limit(spec, h100, Layout(tp=2), allreduce_latency_s=0, layer_latency_s=0)
    assert free.tokens_per_s / one.bandwidth_tokens_per_s == pytest.approx(2.0, abs=0.01)
    # a pipeline does not speed up one sequence: its stages run one after another
    assert decode_limit(spec, h100, Layout(pp=2)).read_s == one.read_s


def test_decode_limit_reads_at_a_copys_bandwidth_not_the_datasheets():
    """The H200's own measured copy, 4.24 of 4.8 TB/s; a measured machine's bandwidth is a copy's already."""
    spec = get_preset("llama-3.1-8b")
    read = (8_030_261_248 - 128_256 * 4096) * 2
    assert decode_limit(spec, get_hardware("h200"), Layout()).read_s == pytest.approx(read / 4.24e12)
    measured = Hardware("measured: a GPU", {"bf16": 1e15}, 2.0e12, 80e9, measured=True, copy_efficiency=1.0)
    assert decode_limit(spec, measured, Layout()).read_s == pytest.approx(read / 2.0e12)


def test_decode_limit_matches_the_engines_batch_1_decode_on_an_h100():
    """A calibration check against a recorded measurement, not a timing test: the engine decoded
    llama-3.1-8b batch 1 at 170.5 tok/s on an H100 SXM, 128-token prompts and 256 new tokens, CUDA
    graphs (benchmarks/results/gpu_tp_fused_h100x4.json, layout "1"); ~256 tokens of context.
    By hand: 15.01 GB of weights + 256 x 128 KiB of bf16 KV at 3.0 TB/s (5.01 ms), 32 layers x 24.6 us
    (0.79 ms): 5.80 ms, 172.4 tok/s."""
    limit = decode_limit(get_preset("llama-3.1-8b"), get_hardware("h100-sxm"), Layout(), 256)
    assert limit.tokens_per_s == pytest.approx(170.5, rel=0.05)


def test_layout_advice():
    h100 = get_hardware("h100-sxm")
    big, small = get_preset("llama-3.1-70b"), get_preset("llama-3.1-8b")
    # 141 GB of weights: TP 2 leaves 71.0 - 70.6 GB, less than 8192 tokens of KV; TP 4 fits
    advice = advise_layout(big, h100, 8, "throughput", 8192, 1)
    assert [a.option for a in advice] == ["--tensor-parallel-size 4",
                                          "--tensor-parallel-size 4 --data-parallel-size 2"]
    # fits one GPU: replicas for throughput, TP for one sequence's latency
    assert [a.option for a in advise_layout(small, h100, 8, "throughput", 8192, 1)] == ["--data-parallel-size 8"]
    latency = advise_layout(small, h100, 8, "latency", 8192, 1)
    assert [a.option for a in latency] == ["--tensor-parallel-size 8"]
    # an 8000-token prompt is ~1.37e14 FLOPs: >= 138 ms at 989 TFLOP/s, over a 50 ms TPOT target
    disaggregate = advise_layout(small, h100, 2, "throughput", 8192, 1, prompt_len=8000, tpot_target_s=0.05)
    assert disaggregate[-1].option.startswith("prefill / decode disaggregation") and "138 ms" in disaggregate[-1].why
    assert len(advise_layout(small, h100, 2, "throughput", 8192, 1, prompt_len=1000, tpot_target_s=0.05)) == 1


# llama-3.1-8b at PP=2 on an H100: a step reads 15_009_849_344 B of bf16 weights (8.03 B parameters less the
# 128256 x 4096 embedding table, of which a token reads one row) at the 3.0 TB/s a copy reaches, 32 layers x
# 24.6 us, one 8.5 us handoff; fp16 KV of 2 x 32 layers x 8 heads x 128 x 2 B = 131072 B a token of context.
WEIGHTS_8B = (8_030_261_248 - 128_256 * 4096) * 2
COPY_H100 = 3.0e12
FIXED_8B_PP2_S = 32 * 24.6e-6 + 8.5e-6


def test_micro_batches_split_what_grows_with_the_rows_not_the_weight_read():
    spec, h100 = get_preset("llama-3.1-8b"), get_hardware("h100-sxm")
    off, on = Layout(pp=2), Layout(pp=2, micro_batches=True)
    # No context: a step is the weight read, which each micro-batch repeats: no gain
    alone = 32 / (WEIGHTS_8B / COPY_H100 + FIXED_8B_PP2_S)  # 5518 tok/s
    assert decode_tokens_per_s(spec, h100, off, 0, 32, kv_dtype="fp16")[0] == pytest.approx(alone)
    assert decode_tokens_per_s(spec, h100, on, 0, 32, kv_dtype="fp16")[0] == pytest.approx(alone)
    # 4096 tokens of context: one step at a time reads 32 sequences' KV in a pass (11.53 ms), micro-batches
    # 16 (8.66 ms): 2776 against 3694 tok/s, and each sequence's token comes that much sooner
    whole = WEIGHTS_8B / COPY_H100 + 32 * 4096 * 131072 / COPY_H100 + FIXED_8B_PP2_S
    half = WEIGHTS_8B / COPY_H100 + 16 * 4096 * 131072 / COPY_H100 + FIXED_8B_PP2_S
    assert decode_tokens_per_s(spec, h100, off, 4096, 32, kv_dtype="fp16") == pytest.approx((32 / whole, whole))
    assert decode_tokens_per_s(spec, h100, on, 4096, 32, kv_dtype="fp16") == pytest.approx((32 / half, half))
    # one sequence has one micro-batch: nothing to overlap
    assert decode_tokens_per_s(spec, h100, on, 4096, 1) == decode_tokens_per_s(spec, h100, off, 4096, 1)


def test_micro_batches_double_a_compute_bound_pipeline_of_two():
    """1 TFLOP/s against 1 TB/s: at 32 rows the matmuls (2 x 7_504_924_672 FLOPs a row) take 0.480 s, the
    weight read 0.016 s; two micro-batches of 16 halve the pass."""
    spec, slow = get_preset("llama-3.1-8b"), Hardware("slow", {"bf16": 1e12}, 1e12, 80e9)
    assert decode_limit(spec, slow, Layout(pp=2), 0, 32).compute_s == pytest.approx(32 * 2 * 7_504_924_672 / 1e12)
    off = decode_tokens_per_s(spec, slow, Layout(pp=2), 0, 32)[0]
    on = decode_tokens_per_s(spec, slow, Layout(pp=2, micro_batches=True), 0, 32)[0]
    assert off == pytest.approx(32 / (32 * 2 * 7_504_924_672 / 1e12 + FIXED_8B_PP2_S))  # 66.5 tok/s
    assert on == pytest.approx(32 / (16 * 2 * 7_504_924_672 / 1e12 + FIXED_8B_PP2_S))  # 132.8 tok/s


def test_stage_handoff_bytes():
    # hidden states and residual: 2 x 32 tokens x 8192 hidden x 2 bytes from each GPU of a stage
    assert handoff_bytes(get_preset("llama-3.1-70b"), 32) == 2 * 32 * 8192 * 2


def test_calc_prints_a_pipeline_with_and_without_micro_batches(capsys):
    argv = ("fit", "--model", "llama-3.1-8b", "--pp", "2", "--batch", "32", "--seq-len", "4096")
    assert run_calc(*argv) == 0
    default = capsys.readouterr().out  # on an H100 the engine runs one step at a time
    assert "stage handoffs per decode step of 32 tokens: 1, each 0.52 MB" in default  # 2 x 32 x 4096 x 2 B
    # the passes of test_micro_batches_split_what_grows_with_the_rows_not_the_weight_read
    assert "one step at a time: ~2776 tok/s, each sequence a token every 11.53 ms  <- this layout" in default
    assert "micro-batches (2 in the stages at once, ~16 sequences each): ~3694 tok/s, each sequence a token " \
           "every 8.66 ms\n" in default
    assert run_calc(*argv, "--pipeline-micro-batches") == 0
    on = capsys.readouterr().out
    assert "~2776 tok/s, each sequence a token every 11.53 ms\n" in on and "every 8.66 ms  <- this layout" in on
    assert run_calc(*argv, "--gpu", "cpu") == 0  # the engine's CPU default: micro-batches
    assert "ms  <- this layout" in capsys.readouterr().out.split("micro-batches (2 in")[1]
    assert run_calc(*argv, "--gpu", "cpu", "--no-pipeline-micro-batches") == 0
    assert "ms  <- this layout" not in capsys.readouterr().out.split("micro-batches (2 in")[1]


# llama-3.1-70b in fp32 (282 GB) on 40 GB A100s: TP 8 leaves no room for KV, TP 8 x PP 2 fits.
BIG = dict(spec=get_preset("llama-3.1-70b"), hw=get_hardware("a100-40gb"), seq_len=4096, dtype="fp32")


def pipeline_advice(gpus: int, batch: int, goal: str = "throughput", micro_batches: bool = False) -> list[str]:
    return [a.option for a in advise_layout(BIG["spec"], BIG["hw"], gpus, goal, BIG["seq_len"], batch, BIG["dtype"],
                                            micro_batches=micro_batches)]


def test_layout_advice_on_pipeline_micro_batches():
    micro = "--pipeline-micro-batches"
    assert pipeline_advice(16, 64) == ["--tensor-parallel-size 8 --pipeline-parallel-size 2", micro]
    # 2 replicas of 32 sequences each: still one for every stage
    assert pipeline_advice(32, 64)[-1] == micro
    assert pipeline_advice(16, 2)[-1] == micro  # a sequence for each stage
    assert micro not in pipeline_advice(16, 1)  # one sequence: nothing to overlap
    assert micro not in pipeline_advice(32, 2)  # 2 replicas of one sequence each
    assert micro not in pipeline_advice(16, 64, micro_batches=True)  # already on
    assert micro not in pipeline_advice(16, 64, goal="latency")  # one sequence's token crosses every stage
    assert micro not in [a.option for a in advise_layout(get_preset("llama-3.1-8b"), get_hardware("h100-sxm"), 8,
                                                         "throughput", 4096, 64)]  # no pipeline
    why = advise_layout(BIG["spec"], BIG["hw"], 16, "throughput", BIG["seq_len"], 64, BIG["dtype"])[-1].why
    # compute-bound in fp32 (19.5 TFLOP/s): two micro-batches of 32 nearly halve the pass
    assert "~1827 tok/s a replica against ~959 one step at a time by the roofline (1.90x" in why
    assert "on CUDA they pay only once each stage's step is not host-bound" in why
    assert "0.88x" in why and "gpu_pipeline_microbatch_h200x2.json" in why
    on_cpu = micro_batch_advice(get_preset("smollm2-135m"), get_hardware("cpu"), Layout(pp=2), 256, 32, "fp32",
                                "fp32").why
    assert "1.29x" in on_cpu and "cpu_pipeline_microbatch_intel.json" in on_cpu and "CUDA" not in on_cpu


def test_calc_command_fit_with_a_parallel_layout(capsys):
    assert run_calc("fit", "--model", "llama-3.1-70b", "--tensor-parallel-size", "4", "--seq-len", "8192",
                    "--batch", "16", "--gpus", "8") == 0
    out = capsys.readouterr().out
    assert "TP 4 x PP 1 x DP 1 = 4 x h100-sxm: fits" in out
    assert "weights 35.3 GB" in out and "2 of 8 KV heads" in out
    assert "all-reduce per decode step of 16 tokens: 41.94 MB per GPU (160 all-reduces), ring sends 62.91 MB" in out
    # a GPU reads 139.0 / 4 GB of weights and 8192 x 2 (K, V) x 80 layers x 2 of 8 heads x 128 x 2 B of KV,
    # 35.42 GB at 3.0 TB/s: 11.81 ms, 85 tok/s; 80 layers x 24.6 us
    assert ("decodes at ~85 tok/s by bandwidth alone (its reads at the 3000 GB/s a copy reaches of the datasheet's "
            "3350)") in out and "kernel latencies (1.97 ms)" in out
    assert "--data-parallel-size 2" in out
    assert run_calc("fit", "--model", "llama-3.1-70b", "--tp", "2", "--pp", "2", "--dp", "2", "--batch", "2") == 0
    assert "TP 2 x PP 2 x DP 2 = 8 x h100-sxm: fits" in capsys.readouterr().out
