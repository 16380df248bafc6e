"""End to end: goodserve bench against a live `goodserve serve` on loopback, and against the engine
in-process. The bench's request and token counts must agree with the server's own /metrics."""

import asyncio

import pytest

from goodserve.bench import command
from goodserve.bench.arrivals import ArrivalConfig
from goodserve.bench.result import load_json
from goodserve.bench.runner import BenchRun
from goodserve.bench.text import PromptText
from goodserve.bench.workloads import WorkloadConfig, build_workload
from goodserve.diagnose.observations import scrape
from helpers import InProcessServer
from test_bench_client import bench_args

MAX_MODEL_LEN = "128"


@pytest.fixture(scope="module")
def server_url():
    with InProcessServer(["--max-model-len", MAX_MODEL_LEN, "--log-level", "warning"]) as server:
        yield server.url


def test_bench_counts_agree_with_server_metrics(server_url, tmp_path):
    before = scrape(f"{server_url}/metrics")
    out = tmp_path / "live.json"
    args = bench_args("--base-url", server_url, "--model", "smollm2-135m", "--tokenizer", "smollm2-135m",
                      "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "4",
                      "--random-range-ratio", "0.5", "--ignore-eos", "--max-concurrency", "4",
                      "--goodput", "ttft:60000", "--result-filename", str(out))
    assert command.run_command(args) == 0
    after = scrape(f"{server_url}/metrics")
    result = load_json(out)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert result["completed"] == 6 and result["failed"] == 0 and len(result["records"]) == 6
    assert delta("request_success_total") == 6
    assert result["total_input_tokens"] == delta("prompt_tokens_total")
    assert result["total_output_tokens"] == delta("generation_tokens_total")
    for record in result["records"]:
        assert record["output_len"] == record["expected_output_len"]  # --ignore-eos: all it asked for
        assert record["output_len_source"] == "usage"
        assert len(record["chunk_times"]) >= 1 and record["ttft"] > 0
        assert record["chunk_times"] == sorted(record["chunk_times"])
    assert result["slo_attainment"] == 100.0
    # The step-time split survives the scrape per phase (what diagnose's host share reads).
    phases = [after[f"step_time_seconds_total{{phase={p}}}"] for p in
              ("schedule", "prepare", "forward", "sample", "detokenize", "output")]
    assert sum(phases) == pytest.approx(after["step_time_seconds_total"]) and min(phases) > 0
    assert after["gc_pause_seconds_count"] == sum(after[f"gc_pause_seconds_count{{generation={g}}}"] for g in range(3))
    # The server's engine, as its /metrics info metric names it: the CPU's real dtype and the
    # quantization the engine resolved (a GGUF model on the CPU keeps its codes), not a guess.
    engine = result["engine_config"]
    assert (engine["model"], engine["dtype"], engine["device"], engine["quantization"]) == (
        "smollm2-135m", "float32", "cpu", "gguf")


def test_chat_endpoint_against_live_server(server_url, tmp_path):
    out = tmp_path / "chat.json"
    args = bench_args("--base-url", server_url, "--backend", "openai-chat", "--model", "smollm2-135m",
                      "--dataset-name", "multiturn", "--multiturn-num-turns", "2", "--num-prompts", "4",
                      "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
                      "--result-filename", str(out))
    assert command.run_command(args) == 0
    result = load_json(out)
    assert result["completed"] == 4 and result["total_output_tokens"] == 16
    second_turns = [r for r in result["records"] if r["index"] >= 2]
    first_turns = [r for r in result["records"] if r["index"] < 2]
    # The second turn carries the first exchange, so its prompt is longer.
    assert min(r["prompt_len"] for r in second_turns) > max(r["prompt_len"] for r in first_turns)


# The engine process starts an interpreter and loads the model again: the full tier's (the fast tier
# meets the engine process in test_server_openai.py).
@pytest.mark.parametrize("engine_process", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["engine-thread", "engine-process"])
def test_inprocess_target_drives_the_engine(engine_process):
    from goodserve.bench.inprocess import InProcessTarget
    from goodserve.config import EngineConfig

    config = EngineConfig(model="smollm2-135m", max_model_len=int(MAX_MODEL_LEN), device="cpu")
    target = InProcessTarget(config, ignore_eos=True, engine_process=engine_process)
    requests = build_workload(WorkloadConfig(num_prompts=3, random_input_len=8, random_output_len=4),
                              PromptText(target.tokenizer))

    async def go():
        try:
            return await BenchRun(target, requests, ArrivalConfig(max_concurrency=2)).run()
        finally:
            await target.close()

    records = asyncio.run(go())
    assert [r.index for r in records] == [0, 1, 2]
    for record, request in zip(records, requests):
        assert record.success, record.error
        assert record.output_len == 4 and len(record.chunk_times) == 4  # one token per engine step
        # The engine's own prompt count: the text re-encoded (plus BOS, if the template adds one).
        assert abs(record.prompt_len - request.prompt_len) <= 2
        assert record.ttft > 0 and record.tpot > 0
        # The engine's times lie inside the client's: it saw the request after it was sent, and its
        # tokens before the client read them (a small allowance: two clocks).
        assert 0 < record.engine_ttft <= record.ttft + 1e-3
        assert 0 < record.engine_tpot <= record.tpot * 1.5 + 1e-3


def test_inprocess_runs_share_no_prompt_prefix():
    """A model without a tokenizer gets prompts of made-up ids: the second of two runs on one target
    (gpu_slo.py's next rung) must find none of the first's prompts in the prefix cache."""
    from goodserve.bench.inprocess import InProcessTarget
    from goodserve.config import EngineConfig

    target = InProcessTarget(EngineConfig(model="dummy:tiny", device="cpu"), ignore_eos=True)
    requests = build_workload(WorkloadConfig(num_prompts=3, random_input_len=48, random_output_len=2), PromptText(None))

    async def go():
        try:
            return [await BenchRun(target, requests, ArrivalConfig(max_concurrency=1)).run() for _ in range(2)]
        finally:
            await target.close()

    first, second = asyncio.run(go())
    assert all(r.success for r in first + second)
    assert [r.prompt_len for r in second] == [r.prompt_len for r in first] == [r.prompt_len for r in requests]
    assert [r.cached_tokens for r in second] == [0, 0, 0]


def test_engine_latencies_are_read_off_the_engines_token_times():
    from goodserve.bench.inprocess import _engine_latencies
    from goodserve.outputs import RequestMetrics

    metrics = RequestMetrics(arrival_time=100.0, first_token_time=100.25, last_token_time=100.55)
    assert _engine_latencies(metrics, 4) == pytest.approx((0.25, 0.1))  # 3 gaps after the first token
    assert _engine_latencies(metrics, 1) == (pytest.approx(0.25), None)
