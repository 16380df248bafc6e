"""What goodserve tune reads: workloads (profiles, files, serve's recordings of real traffic), its
--try / --quality-budget items, and the config file it writes for `serve --config`."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx2
import numpy as np
import pytest

from goodserve.bench.text import PromptText
from goodserve.bench.workloads import WorkloadConfig, build_workload
from goodserve.errors import InvalidRequestError
from goodserve.server.command import register as register_serve
from goodserve.server.config_file import apply_config_file
from goodserve.tune.command import parse_budget, parse_try
from goodserve.tune.workload import bench_workload_argv, recorded_burstiness


def test_profiles_and_files_become_bench_flags(tmp_path):
    assert bench_workload_argv("sharegpt-like")[:2] == ["--dataset-name", "sharegpt"]
    argv = bench_workload_argv("random", input_len=16, output_len=8)
    assert argv[argv.index("--random-input-len", 2) + 1] == "16"  # the override follows the profile's own
    assert argv[argv.index("--sharegpt-output-len") + 1] == "8"
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "hello", "output_tokens": 4}\n')
    assert bench_workload_argv(str(dataset)) == ["--dataset-name", "custom", "--dataset-path", str(dataset)]
    with pytest.raises(InvalidRequestError, match="neither a profile"):
        bench_workload_argv("no-such-profile")


def test_burstiness_is_the_gamma_shape_of_the_recorded_gaps():
    rng = np.random.default_rng(0)
    poisson = np.cumsum(rng.exponential(0.1, 4000))
    assert recorded_burstiness(list(poisson)) == pytest.approx(1.0, abs=0.1)
    bursty = np.cumsum(rng.gamma(0.25, 0.4, 4000))  # shape 0.25: CV^2 = 4
    assert recorded_burstiness(list(bursty)) == pytest.approx(0.25, abs=0.05)
    assert recorded_burstiness([0.0, 1.0, 2.0, 3.0]) == 20.0  # even gaps: as even as bench goes


def test_try_and_budget_items_are_typed_and_checked_as_flags():
    assert parse_try("quantization=int4") == {"quantization": "int4"}
    assert parse_try("max-num-seqs=64") == {"max_num_seqs": 64}
    assert parse_try("enable_prefix_caching=false") == {"enable_prefix_caching": False}
    with pytest.raises(InvalidRequestError, match="OPTION=VALUE"):
        parse_try("no_such_option=1")
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        parse_try("quantization=int3")
    assert parse_budget(["perplexity:0.02", "greedy:0.8"]) == {"perplexity": 0.02, "greedy": 0.8}
    for bad in ("perplexity", "speed:2", "top1:x", "top1:-1"):
        with pytest.raises(InvalidRequestError, match="quality-budget"):
            parse_budget([bad])


def serve_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    return parser, parser._subparsers._group_actions[0].choices["serve"]


def test_serve_reads_a_config_file_checked_as_its_flags(tmp_path):
    parser, serve = serve_parser()
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"quantization": "gguf", "max-num-seqs": 64, "enable_prefix_caching": False,
                                "port": 9000}))
    args = parser.parse_args(["serve", "--port", "8100"])
    apply_config_file(args, serve, str(path))
    assert (args.quantization, args.max_num_seqs, args.enable_prefix_caching) == ("gguf", 64, False)
    assert args.port == 8100  # the command line wins
    for content, message in [({"max_num_seq": 1}, "unknown option"), ({"max_num_seqs": "64"}, "integer"),
                             ({"max_num_seqs": 1.5}, "integer"), ({"quantization": "int3"}, "not one of"),
                             ({"enable_prefix_caching": "no"}, "true or false"), ([1], "JSON object")]:
        path.write_text(json.dumps(content))
        with pytest.raises(InvalidRequestError, match=message):
            apply_config_file(parser.parse_args(["serve"]), serve, str(path))
    path.write_text("{")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        apply_config_file(parser.parse_args(["serve"]), serve, str(path))


def test_serve_records_traffic_that_tune_replays(tmp_path):
    """A real app in-process records each accepted prompt hashed; the recording replays through
    bench's custom dataset (same hash, same stand-in text) with its burstiness fitted."""
    from goodserve.config import EngineConfig
    from goodserve.engine.frontend.async_engine import AsyncEngine
    from goodserve.server.app import ServerConfig, build_app

    recording = tmp_path / "traffic.jsonl"
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", device="cpu"))
    app = build_app(engine, ServerConfig(record_requests=str(recording), data_dir=str(tmp_path / "data")))

    async def send() -> list[int]:
        await engine.start()
        statuses = []
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as client:
            for prompt in ([5, 6, 7], [5, 6, 7], [9] * 10, [1] * 100_000):  # the last can never fit: not recorded
                response = await client.post("/v1/completions", json={"model": "dummy:tiny", "prompt": prompt,
                                                                       "max_tokens": 2})
                statuses.append(response.status_code)
        await engine.shutdown(5.0)
        app.state.ctx.close()
        return statuses

    assert asyncio.run(send()) == [200, 200, 200, 400]
    rows = [json.loads(line) for line in recording.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [3, 3, 10] and all(r["output_tokens"] == 2 for r in rows)
    assert rows[0]["prompt_sha256"] == rows[1]["prompt_sha256"] != rows[2]["prompt_sha256"]
    assert "prompt" not in rows[0] and rows[0]["arrival_s"] <= rows[1]["arrival_s"] <= rows[2]["arrival_s"]

    argv = bench_workload_argv(str(recording))
    assert argv[:4] == ["--dataset-name", "custom", "--dataset-path", str(recording)] and "--burstiness" in argv
    requests = build_workload(WorkloadConfig(dataset_name="custom", dataset_path=str(recording), num_prompts=3),
                              PromptText(None))
    assert requests[0].prompt == requests[1].prompt != requests[2].prompt
    assert [r.prompt_len for r in requests] == [3, 3, 10] and [r.output_len for r in requests] == [2, 2, 2]
