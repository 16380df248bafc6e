"""`goodserve batch run` and the line runner under it, over the in-process engine (dummy:tiny): every
line answered once, malformed ones with their line numbers, resume from a partial output, lines at
the lowest priority and never more in the engine than the concurrency bound; and a server job past
its expires_at."""

from __future__ import annotations

import asyncio
import json

from goodserve.cli import main
from goodserve.commands.batch import run_file
from goodserve.config import EngineConfig
from goodserve.engine.frontend.admission import Admission
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.server.batch_lines import BATCH_PRIORITY, ENDPOINTS, parse_lines
from goodserve.server.batch_runner import BatchRunner
from goodserve.server.batch_store import BatchStore
from goodserve.server.metrics import ServerMetrics, Slo
from goodserve.server.serving import ServingContext

ENGINE = ["--model", "dummy:tiny", "--num-kv-blocks", "64"]


def write_lines(path, lines: list[dict | str]) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def completion(custom_id: str, max_tokens: int = 3) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True}}


def read_records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_batch_run_answers_every_line_once(tmp_path, capsys):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    embedding = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": [5, 6, 7]}}
    write_lines(source, [completion("a"), "[1, 2]", embedding, completion("b")])
    assert main(["batch", "run", str(source), str(output), *ENGINE]) == 0
    records = {r["custom_id"] or r["error"]["line"]: r for r in read_records(output)}
    assert set(records) == {"a", 2, "e", "b"}
    assert records[2]["error"]["message"] == "line 2 is not a JSON object"
    assert records["a"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert records["e"]["response"]["body"]["data"][0]["object"] == "embedding"
    assert "3 lines succeeded, 1 failed" in capsys.readouterr().err


def test_batch_run_resumes_after_the_lines_already_answered(tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [completion(f"r{i}") for i in range(5)])
    done = [{"custom_id": f"r{i}", "response": {"status_code": 200, "body": "earlier run"}, "error": None}
            for i in (0, 3)]
    output.write_text("".join(json.dumps(r) + "\n" for r in done) + '{"custom_id": "r1", "resp')  # killed mid-line
    assert main(["batch", "run", str(source), str(output), *ENGINE]) == 0
    records = read_records(output)
    assert sorted(r["custom_id"] for r in records) == [f"r{i}" for i in range(5)]
    assert records[:2] == done  # kept, not run again


def test_lines_reach_the_engine_at_the_lowest_priority_within_the_concurrency_bound(tmp_path):
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=64))
    seen, in_flight, most = [], set(), 0
    add, release = engine.add, engine.release

    def spy_add(request_id, prompt, params, deliver):
        nonlocal most
        seen.append(params.priority)
        in_flight.add(request_id)
        most = max(most, len(in_flight))
        add(request_id, prompt, params, deliver)

    def spy_release(request_id):
        in_flight.discard(request_id)
        release(request_id)

    engine.add, engine.release = spy_add, spy_release
    source = tmp_path / "in.jsonl"
    write_lines(source, [completion(f"r{i}", max_tokens=8) for i in range(12)])
    lines = parse_lines(source.read_bytes(), ENDPOINTS)
    assert asyncio.run(run_file(engine, lines, tmp_path / "out.jsonl", 3, "dummy:tiny")) == (12, 0)
    assert seen == [BATCH_PRIORITY] * 12 and most == 3


def test_a_job_past_its_expiry_answers_its_lines_as_expired(tmp_path):
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=64))
    metrics = ServerMetrics(engine, "dummy:tiny", Slo())
    ctx = ServingContext(engine, "dummy:tiny", Admission(64), metrics)
    store = BatchStore(tmp_path)
    content = "".join(json.dumps(completion(f"r{i}")) + "\n" for i in range(3)).encode()
    batch = {"id": "batch_x", "status": "validating", "input_file_id": "file-x", "endpoint": "/v1/completions",
             "expires_at": 1000, "request_counts": {"total": 0, "completed": 0, "failed": 0}}

    async def run() -> dict:
        await engine.start()
        await store.add_file({"id": "file-x", "filename": "x", "purpose": "batch", "bytes": len(content),
                              "created_at": 0}, content)
        await store.add_batch(batch)
        runner = BatchRunner(store, ctx, metrics, max_concurrency=2, clock=lambda: 2000.0)
        await runner.resume()
        await asyncio.gather(*runner.jobs.values())
        await engine.shutdown(0)
        return await store.get_batch("batch_x")

    finished = asyncio.run(run())
    assert (finished["status"], finished["expired_at"], finished.get("output_file_id")) == ("expired", 2000, None)
    assert finished["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    errors = [json.loads(x) for x in store.file_path(finished["error_file_id"]).read_text().splitlines()]
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 3
    store.close()


def test_a_line_refused_for_a_full_waiting_queue_waits_and_runs(tmp_path):
    """Lines of n=2 against a queue of 2 places, 3 at once: the ones refused (429) run later."""
    from goodserve.server.batch_lines import parse_lines, run_lines

    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=64))
    ctx = ServingContext(engine, "dummy:tiny", Admission(2), ServerMetrics(engine, "dummy:tiny", Slo()))
    lines = parse_lines("".join(json.dumps({**completion(f"r{i}"), "body": {**completion(f"r{i}")["body"], "n": 2}})
                                + "\n" for i in range(4)).encode(), ["/v1/completions"])
    results = []

    async def record(result) -> None:
        results.append(result)

    async def run() -> None:
        await engine.start()
        await run_lines(ctx, lines, 3, record)
        await engine.shutdown(0)

    asyncio.run(run())
    assert sorted(r.line.custom_id for r in results if r.ok) == ["r0", "r1", "r2", "r3"]
