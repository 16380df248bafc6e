"""The server's pure parts, against hand-computed values: CLI flags, SLO checks, metric math,
logprob shapes, request-to-SamplingParams mapping, admission counting."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from goodserve.config import EngineConfig
from goodserve.engine.frontend.admission import Admission
from goodserve.engine_args import add_engine_arguments, engine_config_from_args
from goodserve.errors import InvalidRequestError, QueueFullError
from goodserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from goodserve.server.logprobs import chat_logprobs, completion_logprobs
from goodserve.server.metrics import ServerMetrics, Slo, one_two_five_buckets
from goodserve.server.protocol import ChatCompletionRequest, CompletionRequest


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(argv))


def test_every_engine_config_field_is_a_flag_with_its_default():
    assert parse([]) == EngineConfig()
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = {a.dest for a in parser._actions}
    nested = {"kernels"}  # KernelOptions: set from Python (LLM(..., kernels=KernelOptions(...)))
    assert {f.name for f in dataclasses.fields(EngineConfig)} - nested <= flags and not nested & flags


def test_engine_flags_parse_to_config_fields():
    config = parse(["--model", "dummy:tiny", "--max-num-seqs", "7", "--no-enable-prefix-caching",
                    "--max-model-len", "256", "--gpu-memory-utilization", "0.5", "--quantization", "int8",
                    "--enforce-eager"])
    assert (config.model, config.max_num_seqs, config.enable_prefix_caching) == ("dummy:tiny", 7, False)
    assert (config.max_model_len, config.gpu_memory_utilization, config.quantization) == (256, 0.5, "int8")
    assert config.enforce_eager is True
    with pytest.raises(InvalidRequestError):
        parse(["--gpu-memory-utilization", "1.5"])


def test_a_command_keeps_its_own_flag_of_the_same_name():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=99, help="sampling seed")
    add_engine_arguments(parser)  # must not clash with the command's --seed
    assert parser.parse_args([]).seed == 99


def test_length_buckets_go_one_two_five_up_to_the_context():
    assert one_two_five_buckets(10) == (1, 2, 5, 10)
    assert one_two_five_buckets(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def test_slo_met_by_hand():
    slo = Slo(ttft_ms=200, tpot_ms=50)
    assert slo.met(0.2, 0.05)
    assert not slo.met(0.21, 0.01)
    assert not slo.met(0.1, 0.051)
    assert slo.met(0.1, None)  # one output token: no time per output token to miss
    assert not slo.met(None, None)  # never produced a token
    assert Slo().met(100.0, 100.0)


def _output(arrival: float, scheduled: float, token_times: list[float], prompt_len: int) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled, first_token_time=token_times[0],
                             last_token_time=token_times[-1], finished_time=token_times[-1],
                             token_times=token_times)
    completion = CompletionOutput(index=0, text="abc", token_ids=list(range(len(token_times))),
                                  finish_reason="length")
    return RequestOutput("r", None, list(range(prompt_len)), [completion], True, metrics)


@pytest.fixture(scope="module")
def idle_engine():
    from goodserve.engine.frontend.async_engine import AsyncEngine

    return AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=100))  # never started: stats stay zero


def test_request_metrics_from_timestamps_by_hand(idle_engine):
    metrics = ServerMetrics(idle_engine, "m", Slo(ttft_ms=1500, tpot_ms=300))
    metrics.observe_finished(_output(10.0, 10.5, [11.0, 11.2, 11.6], prompt_len=7))  # meets: 1.0 s, 0.3 s
    metrics.observe_finished(_output(20.0, 20.1, [22.0, 22.1], prompt_len=3))  # misses TTFT: 2.0 s
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name",))
            samples[key] = s.value
    p = "goodserve:"
    assert samples[f"{p}time_to_first_token_seconds_sum"] == pytest.approx(1.0 + 2.0)
    assert samples[f"{p}request_queue_time_seconds_sum"] == pytest.approx(0.5 + 0.1)
    assert samples[f"{p}request_prefill_time_seconds_sum"] == pytest.approx(0.5 + 1.9)
    assert samples[f"{p}request_decode_time_seconds_sum"] == pytest.approx(0.6 + 0.1)
    assert samples[f"{p}request_inference_time_seconds_sum"] == pytest.approx(1.1 + 2.0)
    assert samples[f"{p}request_prompt_tokens_sum"] == 10 and samples[f"{p}request_generation_tokens_sum"] == 5
    # 1, 2, 5, ... buckets: prompts of 7 and 3 tokens (one under 5, both under 10), answers of 3 and 2
    assert samples[f"{p}request_prompt_tokens_bucket,le=5.0"] == 1
    assert samples[f"{p}request_prompt_tokens_bucket,le=10.0"] == 2
    assert samples[f"{p}request_generation_tokens_bucket,le=2.0"] == 1
    assert samples[f"{p}e2e_request_latency_seconds_sum"] == pytest.approx(1.6 + 2.1)
    assert samples[f"{p}request_time_per_output_token_seconds_sum"] == pytest.approx(0.3 + 0.1)
    assert samples[f"{p}inter_token_latency_seconds_count"] == 3
    assert samples[f"{p}inter_token_latency_seconds_sum"] == pytest.approx(0.2 + 0.4 + 0.1)
    assert samples[f"{p}prompt_tokens_total"] == 10 and samples[f"{p}generation_tokens_total"] == 5
    assert samples[f"{p}request_slo_total,attained=true"] == 1
    assert samples[f"{p}request_slo_total,attained=false"] == 1
    assert samples[f"{p}request_success_total,finished_reason=length"] == 2
    assert samples[f"{p}num_kv_blocks"] == 100


ENTRIES = [  # two generated tokens (ids 7 then 9), each with its top-2 alternatives
    {7: Logprob(-0.1, 1, "A"), 8: Logprob(-2.5, 2, "B")},
    {9: Logprob(-3.0, 3, "cd"), 4: Logprob(-0.2, 1, "x"), 5: Logprob(-1.9, 2, None)},  # no tokenizer text
]


def test_completion_logprobs_legacy_shape():
    lp = completion_logprobs([7, 9], ENTRIES, k=2, text_offset=5)
    assert lp.tokens == ["A", "cd"]
    assert lp.token_logprobs == [-0.1, -3.0]
    assert lp.top_logprobs == [{"A": -0.1, "B": -2.5}, {"x": -0.2, "token_id:5": -1.9}]  # sampled 'cd' not in top-2
    assert lp.text_offset == [5, 6]


def test_chat_logprobs_openai_shape():
    lp = chat_logprobs([7, 9], ENTRIES, k=1)
    assert [(t.token, t.logprob, t.bytes) for t in lp.content] == [("A", -0.1, [65]), ("cd", -3.0, [99, 100])]
    assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in lp.content] == [[("A", -0.1)], [("x", -0.2)]]


def test_request_fields_map_to_sampling_params():
    params = CompletionRequest(prompt="hi", max_tokens=5, temperature=0, stop="END", top_k=3, min_p=0.1,
                               ignore_eos=True, logprobs=2, seed=4, priority=-1).sampling_params()
    assert (params.max_tokens, params.temperature, params.stop, params.top_k, params.min_p) == (5, 0, ["END"], 3, 0.1)
    assert (params.ignore_eos, params.logprobs, params.seed, params.priority) == (True, 2, 4, -1)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                 max_tokens=9, max_completion_tokens=3, logprobs=True, top_logprobs=4)
    params = chat.sampling_params()
    assert (params.max_tokens, params.logprobs, params.temperature) == (3, 4, 1.0)
    assert chat.messages[0].text() == "a"
    with pytest.raises(InvalidRequestError):
        ChatCompletionRequest(messages=[], top_logprobs=2).sampling_params()


def test_admission_counts_waiting_requests():
    admission = Admission(max_waiting=2)
    admission.admit(2)
    with pytest.raises(QueueFullError):
        admission.admit(1)
    admission.started(1)
    admission.admit(1)
    with pytest.raises(InvalidRequestError):  # more prompts than the queue could ever hold
        Admission(max_waiting=2).admit(3)
