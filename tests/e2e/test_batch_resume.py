"""A Batch API job survives its server: a server killed with SIGKILL mid-job and started again on
the same --data-dir answers every line exactly once, redoing none it had finished. References: the
SQLite database the killed server left behind. The rest of the Batch API runs in process, in
tests/server/test_batch_api.py."""

from __future__ import annotations

import json
import signal
import sqlite3
import time

import openai

from goodserve.server.process import scrape_metrics, start_server
from helpers import HTTP_TIMEOUT_S
from test_batch_api import jsonl, line, records, wait_done


def test_killed_mid_job_resumes_answering_every_line_exactly_once(tmp_path):
    """kill -9 once some lines are done, start again on the same --data-dir: the job resumes."""
    args = ["--model", "dummy:tiny", "--num-kv-blocks", "64", "--data-dir", str(tmp_path),
            "--batch-max-concurrency", "2"]
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 48, "ignore_eos": True}
    num_lines = 60
    server = start_server(args)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        uploaded = client.files.create(
            file=("in.jsonl", jsonl([line(f"r{i}", "/v1/completions", body) for i in range(num_lines)])),
            purpose="batch")
        batch_id = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                         completion_window="24h").id
        while client.batches.retrieve(batch_id).request_counts.completed < 5:
            time.sleep(0.02)
    finally:
        server.stop(signal.SIGKILL)
    with sqlite3.connect(tmp_path / "batch.db") as db:
        finished = dict(db.execute("SELECT custom_id, record FROM batch_lines WHERE batch_id = ?", (batch_id,)))
    assert 5 <= len(finished) < num_lines, "the kill must land mid-job"

    with start_server(args) as restarted:
        restarted.wait_ready()
        client = openai.OpenAI(base_url=f"{restarted.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        batch = wait_done(client, batch_id)
        output = records(client, batch.output_file_id)
        assert f"resuming batch {batch_id}" in restarted.log()
        # Only the lines not finished before the kill ran again.
        rerun = scrape_metrics(restarted.url)["goodserve:batch_lines_total{status=succeeded}"]
        assert rerun == num_lines - len(finished)
    assert batch.status == "completed" and batch.request_counts.completed == num_lines
    assert sorted(r["custom_id"] for r in output) == sorted(f"r{i}" for i in range(num_lines))
    for record in output:  # a line finished before the kill was not run again: same record
        if record["custom_id"] in finished:
            assert record == json.loads(finished[record["custom_id"]])
