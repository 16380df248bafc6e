"""`goodserve serve --disaggregate prefill:0,decode:1` on the CPU (gloo): the embedded model in float32
behind the OpenAI API, driven by the official openai client. Greedy answers, streamed or not, equal a
colocated server's; after requests and aborts both engines hold no KV block; a prefill process that
dies turns requests into a clear 503 without hanging the server; bad flag values are clear CLI errors.
One pair of servers for the module; the tests run in order (the prefill worker's death is last)."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest

from goodserve.cli import main as cli_main
from goodserve.server.process import scrape_metrics, start_server
from helpers import HTTP_TIMEOUT_S

MODEL = "smollm2-135m"
FLAGS = ["--dtype", "float32", "--max-model-len", "2048"]
PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
          "combined movable metal type, oil-based ink and a wooden screw press; within fifty years")
PREFILL_LINE = re.compile(r"prefill worker: pid (\d+)")


@pytest.fixture(scope="module")
def servers():
    colocated = start_server(FLAGS)
    disaggregated = start_server([*FLAGS, "--disaggregate", "prefill:0,decode:1"])
    try:
        colocated.wait_ready(300)
        disaggregated.wait_ready(300)
        yield colocated, disaggregated
    finally:
        disaggregated.stop(signal.SIGKILL)
        colocated.stop(signal.SIGKILL)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(server, prompt: str, **kw) -> str:
    answer = client(server).completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)
    return [c.text for c in answer.choices]


def chat_streamed(server, text: str) -> str:
    stream = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                    max_tokens=24, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def used_blocks(server) -> tuple[float, float]:
    found = scrape_metrics(server.url)
    return (found["goodserve:num_used_kv_blocks{}"], found["goodserve:prefill_num_used_kv_blocks{}"])


def gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def wait_all_freed(server, timeout_s: float = 120.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout_s
    while used_blocks(server) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used_blocks(server)


def test_greedy_answers_equal_a_colocated_servers(servers):
    colocated, disaggregated = servers
    long_prompt = PROMPT + " " + PROMPT.lower()  # several blocks of KV cross
    for kw in ({"max_tokens": 24}, {"max_tokens": 16, "n": 2}, {"max_tokens": 8, "logprobs": 2}):
        assert complete(disaggregated, long_prompt, **kw) == complete(colocated, long_prompt, **kw)
    assert chat_streamed(disaggregated, PROMPT) == chat_streamed(colocated, PROMPT)
    # Several at once: their transfers interleave with the decode side's steps.
    prompts = [f"{i} {PROMPT}" for i in range(4)]
    results = {}

    def ask(prompt: str) -> None:
        results[prompt] = complete(disaggregated, prompt, max_tokens=12)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[p] == complete(colocated, p, max_tokens=12) for p in prompts)
    assert scrape_metrics(disaggregated.url)["goodserve:prefill_num_kv_blocks{}"] > 0
    assert wait_all_freed(disaggregated) == (0, 0)


def test_aborts_free_both_sides(servers):
    _, disaggregated = servers
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx2.Client(base_url=disaggregated.url, timeout=HTTP_TIMEOUT_S) as http:
        # Gone while decoding: a few tokens read, then the connection closed.
        with http.stream("POST", "/v1/completions", json={**body, "prompt": PROMPT}) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(4)]
        # Gone while (or before) the prefill side has it: a long prompt, closed at once.
        for i in range(3):
            with http.stream("POST", "/v1/completions", json={**body, "prompt": f"{i} " + PROMPT * 30}):
                pass
    assert wait_all_freed(disaggregated) == (0, 0)
    assert complete(disaggregated, PROMPT, max_tokens=4)  # still serving


def test_no_room_for_the_kv_here_prefills_it_here(servers, tmp_path):
    colocated, _ = servers
    # A pool of 24 blocks: the first request's ~300-token prompt holds 19 of them while it decodes,
    # so the second's ~120 tokens of KV find no room when they arrive; it waits and is prefilled here.
    with start_server([*FLAGS, "--disaggregate", "prefill:0,decode:1", "--num-kv-blocks", "24",
                       "--max-model-len", "384",
                       "--data-dir", str(tmp_path)]) as small:
        small.wait_ready(300)
        long_prompt, short_prompt = PROMPT * 8, "Once upon a time, " + PROMPT * 3
        results = {}

        def ask(prompt: str, tokens: int) -> None:
            results[prompt] = complete(small, prompt, max_tokens=tokens, extra_body={"ignore_eos": True})

        # The short prompt's KV must come while the long one still decodes (80 tokens); on a starved
        # machine its prefill can take longer than that, so the scenario runs again (at most 3 times).
        for _ in range(3):
            first = threading.Thread(target=ask, args=(long_prompt, 80))
            first.start()
            while not scrape_metrics(small.url)["goodserve:num_requests_running{}"]:
                time.sleep(0.01)
            ask(short_prompt, 8)
            first.join()
            if "prefilled here: no room here for its KV" in small.log():
                break
        assert "prefilled here: no room here for its KV" in small.log()
        assert wait_all_freed(small) == (0, 0)
        prefill_pid = int(PREFILL_LINE.search(small.log()).group(1))
    assert "Application shutdown complete" in small.log()  # SIGTERM (leaving the with) drained it
    assert gone(prefill_pid)  # and stopped its prefill child
    for prompt, tokens in ((long_prompt, 80), (short_prompt, 8)):
        assert results[prompt] == complete(colocated, prompt, max_tokens=tokens, extra_body={"ignore_eos": True})


def test_a_dead_prefill_worker_gives_503_and_the_server_answers(servers):
    _, disaggregated = servers
    pid = int(PREFILL_LINE.search(disaggregated.log()).group(1))
    outcomes = []

    def ask_long(i: int) -> None:
        try:
            outcomes.append(complete(disaggregated, f"{i} " + PROMPT * 50, max_tokens=4))
        except openai.APIStatusError as exc:
            outcomes.append(exc.status_code)

    askers = [threading.Thread(target=ask_long, args=(i,)) for i in range(6)]
    for asker in askers:
        asker.start()
    deadline = time.monotonic() + 120
    while not scrape_metrics(disaggregated.url)["goodserve:prefill_num_requests_waiting{}"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    subprocess.run(["kill", "-KILL", str(pid)], check=True)  # with requests queued there
    for asker in askers:
        asker.join(300)
    assert not any(asker.is_alive() for asker in askers)  # none hangs
    assert 503 in outcomes and all(o == 503 or isinstance(o, list) for o in outcomes)
    with pytest.raises(openai.APIStatusError) as refused:
        complete(disaggregated, PROMPT, max_tokens=4)
    assert refused.value.status_code == 503 and "prefill worker" in refused.value.message
    assert httpx2.get(f"{disaggregated.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 503
    assert f"the prefill worker (pid {pid}) exited with -9" in disaggregated.log()
    assert used_blocks(disaggregated)[0] == 0


@pytest.mark.parametrize("value, message", [
    ("prefill:0", "both roles are needed"),
    ("prefill:0,decode:x", "'x' is not a GPU id"),
    ("prefill:0,decode:0", "different ids"),
    ("prefill:0,1,decode:2", "one prefill and one decode worker"),
    ("encode:0,decode:1", "unknown or repeated role 'encode'"),
])
def test_a_bad_disaggregate_value_is_a_clear_cli_error(value, message, capsys):
    assert cli_main(["serve", "--disaggregate", value]) == 2
    err = capsys.readouterr().err
    assert message in err and "e.g. --disaggregate prefill:0,decode:1" in err
