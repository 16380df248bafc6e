"""benchmarks/gpu_peer_vllm.py off the GPU: the tokenizer both servers read, and goodserve's side of
the prefix and online parts end to end (a real `goodserve serve` loaded by `goodserve bench`) on a
tiny model. vLLM's side needs vLLM and a GPU; its server reads the same tokenizer files through
transformers' AutoTokenizer, as checked here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from goodserve.model.tokenizer_loader import load_tokenizer

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from peer_model import LLAMA_31_8B_CONFIG, tokenizer_for  # noqa: E402

# Ids past the 49,152 of the embedded tokenizer that large dummy models otherwise borrow.
HIGH_IDS = [49152, 100000, 128000, 128009, 128255]


def test_vllm_and_goodserve_read_the_synthetic_tokenizer_alike(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B_CONFIG))  # as vLLM's model directory holds it
    tokenizer_for("dummy:llama-3.1-8b", str(tmp_path))
    text = " ".join(f"t{i}" for i in [5, 1000, *HIGH_IDS, 77])
    expected = [5, 1000, *HIGH_IDS, 77]

    hf = AutoTokenizer.from_pretrained(str(tmp_path))  # what vLLM loads: no Llama class adding a BOS
    assert type(hf) is PreTrainedTokenizerFast and len(hf) == LLAMA_31_8B_CONFIG["vocab_size"]
    assert hf(text)["input_ids"] == expected
    ours = load_tokenizer(str(tmp_path))
    assert ours.vocab_size == LLAMA_31_8B_CONFIG["vocab_size"]
    assert ours.encode(text) == expected

    # Streamed one at a time, every generated id brings text (bench times tokens by their text).
    stream = DecodeStream(skip_special_tokens=False)
    assert [stream.step(ours.backend, i) for i in [5, 49152, 128255]] == ["t5", " t49152", " t128255"]


def test_goodserves_side_of_the_prefix_and_online_parts_runs_on_the_cpu(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(BENCHMARKS.parent / "src"), str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(BENCHMARKS / "gpu_peer_vllm.py"), "--smoke", "--model", "dummy:tiny",
                    "--device", "cpu", "--parts", "prefix,online", "--order", "g", "--online-order", "g",
                    "--online-rates", "4"], env=env, timeout=300, check=True, capture_output=True)
    report = json.loads((tmp_path / "gpu_peer_vllm.json").read_text())

    prefix = report["runs"][0]["prefix"]
    sizes = report["sizes"]
    assert len(prefix["miss_ttft_ms"]) == sizes["prefix_rounds"]
    assert len(prefix["hit_ttft_ms"]) == sizes["prefix_rounds"] * sizes["prefix_hits"]

    online = report["online"][0]
    assert "error" not in online and online["engine_config"]["model"] == "dummy:tiny"
    (probe,) = online["probes"]
    assert probe["request_rate"] == 4 and probe["completed"] == sizes["online_prompts"] and probe["failed"] == 0
    # The server's usage counts exactly the tokens bench asked for: prompts made in the shared
    # tokenizer keep their length through it (smoke: 64 in, 16 out).
    bench = json.loads((tmp_path / online["result_file"]).read_text())
    assert bench["total_input_tokens"] == 64 * sizes["online_prompts"]
    assert bench["total_output_tokens"] == 16 * sizes["online_prompts"]
    assert report["summary"]["goodserve"]["online_capacity_req_s"] > 0


def test_a_ladder_probe_sends_enough_prompts_to_hold_its_highest_rate():
    """Each ladder probe's arrivals last ladder_hold_s at the top rate (200 prompts at 30 req/s end
    before the load holds); the capacity search keeps its own first probe's size."""
    import gpu_peer_vllm

    sizes = gpu_peer_vllm.Sizes()
    ladder = gpu_peer_vllm.online_plan(argparse.Namespace(sizes=sizes, online_rates="24,48", capacity_start_rate=16))
    assert ladder.rates == [24.0, 48.0] and ladder.num_prompts == 48 * sizes.ladder_hold_s > sizes.online_prompts
    search = gpu_peer_vllm.online_plan(argparse.Namespace(sizes=sizes, online_rates="capacity", capacity_start_rate=16))
    assert search.rates is None and search.num_prompts == sizes.online_prompts
