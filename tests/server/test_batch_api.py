"""The Batch API (/v1/files, /v1/batches) on loopback, driven by the official openai client: upload,
create, poll, download, cancel; malformed lines in the error file with their line numbers; an
oversized file refused. tests/e2e/test_batch_resume.py kills a server process mid-job.

References: the same server's online endpoints (a batch line must answer as they do)."""

from __future__ import annotations

import json
import time

import openai
import pytest

from goodserve.server.batch_store import BatchStore, DataDirInUseError
from goodserve.server.process import scrape_metrics
from helpers import HTTP_TIMEOUT_S, InProcessServer

MODEL = "smollm2-135m"
MAX_FILE_BYTES = 64 << 10
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with InProcessServer(["--max-model-len", "512", "--data-dir", str(tmp_path_factory.mktemp("data")),
                          "--batch-max-file-bytes", str(MAX_FILE_BYTES), "--batch-max-concurrency", "2"]) as server:
        yield server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                    timeout=HTTP_TIMEOUT_S)


def jsonl(lines: list[dict | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s}s")


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def finished_batch(client: openai.OpenAI) -> str:
    """A one-line job, run to completion: each test makes its own (pytest-xdist may run a module's tests
    on different workers, each with its own server)."""
    uploaded = client.files.create(file=("one.jsonl", jsonl([line("one", "/v1/completions",
                                                                   {"prompt": "x", "max_tokens": 1})])),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert wait_done(client, batch.id).status == "completed"
    return batch.id


def test_upload_create_poll_download_answers_as_the_online_endpoint(served):
    server, client = served
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    content = jsonl([line(f"chat-{i}", "/v1/chat/completions", {**chat, "seed": i}) for i in range(3)])
    uploaded = client.files.create(file=("requests.jsonl", content), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "file", "batch", len(content), "requests.jsonl")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == content

    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"job": "nightly"})
    assert created.status == "validating" and created.expires_at == created.created_at + 24 * 3600
    batch = wait_done(client, created.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.metadata == {"job": "nightly"}

    online_reply = client.chat.completions.create(**chat)
    online = online_reply.choices[0].message.content
    assert batch.usage.output_tokens == 3 * online_reply.usage.completion_tokens
    assert batch.usage.input_tokens == 3 * online_reply.usage.prompt_tokens
    output = records(client, batch.output_file_id)
    assert [r["custom_id"] for r in output] == ["chat-0", "chat-1", "chat-2"]
    for record in output:
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == online
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert scrape_metrics(server.url)["goodserve:batch_lines_total{status=succeeded}"] >= 3


def test_malformed_lines_go_to_the_error_file_with_their_line_numbers(served):
    _, client = served
    good = {"model": MODEL, "prompt": "Paris is", "max_tokens": 2}
    content = jsonl([
        line("ok-1", "/v1/completions", good),
        "{not json",
        line("wrong-url", "/v1/embeddings", {"input": "x"}),
        "",  # a blank line is skipped, but counts in the numbering
        line("bad-body", "/v1/completions", {"prompt": "x", "max_tokens": "many"}),
        line("refused", "/v1/completions", {**good, "model": "gpt-4o"}),  # the handler's own 404
        line("ok-1", "/v1/completions", good),  # a repeated custom_id
        line("ok-2", "/v1/completions", good),
    ])
    uploaded = client.files.create(file=("mixed.jsonl", content), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 2, 5)
    assert [r["custom_id"] for r in records(client, batch.output_file_id)] == ["ok-1", "ok-2"]
    errors = {r["error"]["line"] if r["error"] else r["custom_id"]: r for r in records(client, batch.error_file_id)}
    assert set(errors) == {2, 3, 5, "refused", 7}
    assert "not valid JSON" in errors[2]["error"]["message"] and errors[2]["custom_id"] is None
    assert "url must be /v1/completions" in errors[3]["error"]["message"]
    assert "max_tokens" in errors[5]["error"]["message"] and errors[5]["custom_id"] == "bad-body"
    assert "repeats line 1" in errors[7]["error"]["message"]
    refused = errors["refused"]["response"]
    assert refused["status_code"] == 404 and "gpt-4o" in refused["body"]["error"]["message"]


def test_oversized_file_and_bad_requests_are_refused(served):
    _, client = served
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert refused.value.status_code == 413 and "batch-max-file-bytes" in refused.value.message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    uploaded = client.files.create(file=("a.jsonl", jsonl([line("a", "/v1/completions", {"prompt": "x"})])),
                                   purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_cancel_stops_the_job_and_keeps_the_finished_lines(served):
    _, client = served
    body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
    content = jsonl([line(f"r{i}", "/v1/completions", body) for i in range(40)])
    uploaded = client.files.create(file=("long.jsonl", content), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_done(client, created.id)
    assert batch.status == "cancelled" and batch.cancelling_at <= batch.cancelled_at
    assert batch.request_counts.completed < 40
    assert len(records(client, batch.output_file_id)) == batch.request_counts.completed
    with pytest.raises(openai.BadRequestError, match="completed"):  # a finished batch stays as it is
        client.batches.cancel(finished_batch(client))


def test_list_pages_newest_first(served):
    _, client = served
    made = [finished_batch(client) for _ in range(3)]
    ids = [b.id for b in client.batches.list(limit=100).data]
    assert ids[:3] == made[::-1]
    first = client.batches.list(limit=1)
    assert first.data[0].id == ids[0] and first.has_more
    assert [b.id for b in client.batches.list(limit=2, after=ids[0]).data] == ids[1:3]
    assert [b.id for b in client.batches.list(limit=1)] == ids  # the client follows the pages itself


def test_one_server_at_a_time_runs_a_data_dirs_jobs(tmp_path):
    first = BatchStore(tmp_path)
    with pytest.raises(DataDirInUseError, match="another goodserve server"):
        BatchStore(tmp_path)
    first.close()
    BatchStore(tmp_path).close()  # free again once the first has gone
