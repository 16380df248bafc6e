"""Server hardening: bad text, amplification, big prompts, cheap-field abuse, slow and half-open
clients, bursts. Each through a real server on loopback.

Two servers: the embedded model (a real tokenizer, its full 8192-token context) for text, and
dummy:tiny (token-id prompts, fast steps) for queue, stream and connection guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading

import httpx2
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers, pre_tokenizers
from tokenizers.models import BPE

from goodserve.model.tokenizer import Tokenizer
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.server.limits import MAX_MESSAGES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from goodserve.server.process import scrape_metrics
from goodserve.server.tokenization import max_prompt_bytes
from helpers import HTTP_TIMEOUT_S, InProcessServer, wait_for_metrics

MAX_WAITING = 50
MAX_N = 16
MAX_UNSENT = 8
HEADER_TIMEOUT_S = 10  # long enough for a busy machine to open MAX_CONNECTIONS sockets and send a request
MAX_CONNECTIONS = 48
TINY_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def text_server():
    server = InProcessServer(["--max-num-seqs", "4", "--cpu-kv-cache-bytes", str(512 << 20)])  # 8192 tokens fit
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def text_url(text_server):
    return text_server.url


@pytest.fixture(scope="module")
def tiny():
    server = InProcessServer([
        "--model", "dummy:tiny", "--max-model-len", str(TINY_MAX_MODEL_LEN), "--max-waiting", str(MAX_WAITING),
        "--max-n", str(MAX_N), "--max-unsent-outputs", str(MAX_UNSENT),
        "--header-timeout-s", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
    ])
    try:
        yield server
    finally:
        server.stop()


def post_json(url: str, path: str, body: dict, **kwargs) -> httpx2.Response:
    """json.dumps escapes a lone surrogate as \\ud800, as a client in another language would send it."""
    return httpx2.post(f"{url}{path}", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=120, **kwargs)


def assert_error(resp: httpx2.Response, status: int, *words: str) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["type"]
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


def rejected(url: str, status: int) -> float:
    return scrape_metrics(url).get(f"goodserve:request_rejected_total{{status={status}}}", 0.0)


# ---- item 4: lone surrogates ------------------------------------------------------------------

LONE = "bad \ud800 text"
SURROGATE_CASES = [
    ("/v1/completions", {"prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", LONE], "max_tokens": 2}, "prompt.1"),
    ("/v1/completions", {"prompt": "fine", "max_tokens": 2, "stop": [LONE]}, "stop.0"),
    ("/v1/completions", {"prompt": "fine", "max_tokens": 2, "model": "smollm2\udfff"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/detokenize", {"tokens": [1], "model": LONE}, "model"),
]


def test_lone_surrogates_anywhere_are_400_naming_the_field_and_counted(text_url):
    before = rejected(text_url, 400)
    for path, body, field in SURROGATE_CASES:
        assert_error(post_json(text_url, path, body), 400, f"{field}: lone UTF-16 surrogate")
    assert rejected(text_url, 400) - before == len(SURROGATE_CASES)
    # A valid pair of escapes is one astral character: accepted, and tokenized as that character.
    emoji = post_json(text_url, "/tokenize", {"prompt": "\U0001F600", "add_special_tokens": False})
    assert emoji.status_code == 200
    assert emoji.json()["tokens"] == embedded_tokenizer().encode("\U0001F600", add_special_tokens=False)
    assert httpx2.get(f"{text_url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200


# ---- item 6: tokenization off the event loop, refusal before tokenizing -------------------------

@contextlib.contextmanager
def held(monkeypatch, owner, name: str):
    """owner.name's calls wait until the test releases them: what the server answers meanwhile
    shows whether that work stalls its event loop, whatever the machine's speed. Yields (entered,
    release): entered is set once a call is under way; on the loop, a held call would stall /health
    until its wait expires."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held_call(*args, **kwargs):
        entered.set()
        assert release.wait(60), f"{name} was never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held_call)
    try:
        yield entered, release
    finally:
        release.set()


async def health_while_held(url: str, calls: list[asyncio.Task], entered: threading.Event,
                            release: threading.Event) -> tuple[int, int, list]:
    """/health's status and how many calls were unfinished when it answered (all held), then their results."""
    assert await asyncio.to_thread(entered.wait, 120), "the held work never started"
    async with httpx2.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
        health = await client.get(f"{url}/health")
    unfinished = sum(not call.done() for call in calls)
    release.set()
    return health.status_code, unfinished, await asyncio.gather(*calls)


def test_health_answers_while_big_prompts_tokenize(text_server, monkeypatch):
    tokenizer = embedded_tokenizer()
    bound = max_prompt_bytes(tokenizer, 8192)
    big = "hello world, this is a test. " * (bound // 30 - 10)  # just under the byte bound: tokenized,
    # then refused for its tokens (more than the context), which the refusal counts
    assert len(big.encode()) <= bound

    async def scenario(entered, release):
        async with httpx2.AsyncClient(timeout=300) as client:
            calls = [asyncio.create_task(client.post(f"{text_server.url}/tokenize", json={"prompt": big}))
                     for _ in range(3)]
            return await health_while_held(text_server.url, calls, entered, release)

    with held(monkeypatch, text_server.app.state.ctx.encoder, "_encode") as gate:
        health, unfinished, results = asyncio.run(scenario(*gate))
    assert health == 200
    assert unfinished == 3  # /health waited for none of them
    expected = len(tokenizer.encode(big))
    assert [(r.status_code, r.json()["error"]["message"]) for r in results] == \
        [(400, f"prompt: {expected} token ids, more than this model's context (8192)")] * 3


def test_health_answers_while_a_grammar_compiles(text_server, monkeypatch):
    """A json_schema request's grammar compiles at admission (~2 s on a 2-core CPU for this one:
    xgrammar's tokenizer set-up on this server's first grammar, then 120 pattern fields): on the
    server's compile thread, not the event loop."""
    fields = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 9}}}"} for i in range(120)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    body = {"messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}}

    async def scenario(entered, release):
        async with httpx2.AsyncClient(timeout=300) as client:
            call = asyncio.create_task(client.post(f"{text_server.url}/v1/chat/completions", json=body))
            return await health_while_held(text_server.url, [call], entered, release)

    with held(monkeypatch, text_server.app.state.ctx.grammars, "compile_grammar") as gate:
        health, unfinished, [reply] = asyncio.run(scenario(*gate))
    assert health == 200 and unfinished == 1  # /health answered while the compile waited
    assert reply.status_code == 200, reply.text


def test_prompt_bytes_past_what_the_context_can_hold_are_400_before_tokenizing(text_url):
    bound = max_prompt_bytes(embedded_tokenizer(), 8192)
    huge = "a" * (bound + 1)
    for path, body in [("/v1/completions", {"prompt": huge}), ("/v1/completions", {"prompt": ["ok", huge]}),
                       ("/tokenize", {"prompt": huge}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})]:
        assert_error(post_json(text_url, path, body), 400, f"{bound + 1} UTF-8 bytes", "8192 tokens")


def test_max_prompt_bytes_bounds_the_bytes_of_any_token():
    tokenizer = embedded_tokenizer()
    bound = max_prompt_bytes(tokenizer, 1)
    assert bound is not None
    # Every token's own text, decoded, fits the one-token bound (byte-level: one char per byte).
    longest = max(len(tokenizer.decode([i], skip_special_tokens=False).encode())
                  for i in range(tokenizer.vocab_size))
    assert longest <= bound


def _bpe_tokenizer(normalizer=None, pre_tokenizer=None) -> Tokenizer:
    backend = HFTokenizer(BPE(vocab={"a": 0, "b": 1, "\u2581": 2, "ab": 3, "abab": 4},
                              merges=[("a", "b"), ("ab", "ab")]))
    backend.normalizer, backend.pre_tokenizer = normalizer, pre_tokenizer
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[])


def test_no_byte_bound_where_the_tokenizer_may_drop_or_fold_text():
    # Kept text: the bound is the longest token's UTF-8 bytes ('\u2581' is 3; 4 covers an unknown char).
    assert max_prompt_bytes(_bpe_tokenizer(), 10) == 40
    keeps = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    assert max_prompt_bytes(_bpe_tokenizer(keeps, pre_tokenizers.Metaspace()), 10) == 40
    # NFC folds 3 jamo into 1 syllable; Whitespace drops spaces; a shorter Replace shrinks.
    for normalizer, pre_tokenizer in [(normalizers.NFC(), None), (None, pre_tokenizers.Whitespace()),
                                      (normalizers.Replace(" ", ""), None),
                                      (None, pre_tokenizers.Split(" ", behavior="removed"))]:
        assert max_prompt_bytes(_bpe_tokenizer(normalizer, pre_tokenizer), 10) is None


# ---- item 7: cheap fields are bounded ------------------------------------------------------------

def test_list_and_string_fields_past_their_bound_are_400_naming_field_and_bound(tiny):
    base = {"prompt": [5, 6], "max_tokens": 2}
    cases = [
        ({**base, "stop": ["x"] * 350_000}, "stop", str(MAX_STOP_STRINGS)),
        ({**base, "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", str(MAX_STOP_STRING_CHARS)),
        ({**base, "stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop.0", str(MAX_STOP_STRING_CHARS)),
        ({**base, "stop_token_ids": [3] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", str(MAX_STOP_TOKEN_IDS)),
    ]
    for body, field, bound in cases:
        assert_error(post_json(tiny.url, "/v1/completions", body), 400, f"{field}:", bound)
    chat = {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}
    assert_error(post_json(tiny.url, "/v1/chat/completions", chat), 400, "messages:", str(MAX_MESSAGES))
    at_bound = {**base, "stop": ["x"] * MAX_STOP_STRINGS, "stop_token_ids": [3] * MAX_STOP_TOKEN_IDS}
    assert post_json(tiny.url, "/v1/completions", at_bound).status_code == 200


# ---- item 5: prompts x n against admission, --max-n ----------------------------------------------

def test_prompts_times_n_count_against_the_waiting_queue(tiny):
    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0)
    prompts = [[5, 6, 7]] * 10
    with pytest.raises(openai.BadRequestError, match=f"--max-n {MAX_N}"):
        client.completions.create(model="dummy:tiny", prompt=[5, 6], n=MAX_N + 1, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"60 sequences.*--max-waiting {MAX_WAITING}"):
        client.completions.create(model="dummy:tiny", prompt=prompts, n=6, max_tokens=2)
    fits = client.completions.create(model="dummy:tiny", prompt=prompts, n=5, max_tokens=2)
    assert len(fits.choices) == 50


# ---- item 8: slow and half-open clients -----------------------------------------------------------

@pytest.mark.slow  # waits out the server's 10 s header deadline
def test_connections_that_never_finish_their_headers_are_closed(tiny):
    host, port = tiny.url.removeprefix("http://").split(":")
    sockets = [socket.create_connection((host, int(port))) for _ in range(20)]
    try:
        for i, sock in enumerate(sockets):
            if i % 2:  # half the headers; the others send nothing at all
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            sock.settimeout(HTTP_TIMEOUT_S)
        for sock in sockets:
            try:
                assert sock.recv(1024) == b""  # the server closed it
            except ConnectionResetError:
                pass
    finally:
        for sock in sockets:
            sock.close()
    assert httpx2.post(f"{tiny.url}/v1/completions", json={"prompt": [5], "max_tokens": 2},
                       timeout=HTTP_TIMEOUT_S).status_code == 200



def test_stream_whose_client_stops_reading_is_aborted_and_frees_its_blocks(tiny):
    max_tokens = TINY_MAX_MODEL_LEN - 8
    before = scrape_metrics(tiny.url)
    aborted = "goodserve:request_success_total{finished_reason=abort}"
    # ~16 KB of events a step: past what loopback's socket buffers (4 MB) take long before max_tokens.
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "n": MAX_N, "logprobs": 20}).encode()
    host, port = tiny.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing more
    sock.connect((host, int(port)))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        # The engine lets go of it while its client is still connected, long before max_tokens.
        m = wait_for_metrics(tiny.url, lambda m: m["goodserve:num_requests_running{}"] == 0
                      and m["goodserve:num_used_kv_blocks{}"] == 0)
        assert m["goodserve:engine_steps_total{}"] - before["goodserve:engine_steps_total{}"] < max_tokens
    finally:
        sock.close()
    wait_for_metrics(tiny.url, lambda m: m.get(aborted, 0) == before.get(aborted, 0) + 1)


# ---- item 9: a burst gets answers, never connection errors -----------------------------------------

def test_burst_gets_200_or_a_json_429_503_with_retry_after_never_a_connection_error(tiny):
    burst = 3 * MAX_CONNECTIONS
    before = {status: rejected(tiny.url, status) for status in (429, 503)}

    async def one(client: httpx2.AsyncClient) -> httpx2.Response:
        return await client.post(f"{tiny.url}/v1/completions",
                                 json={"prompt": [5, 6, 7], "max_tokens": 32, "ignore_eos": True, "n": 2})

    async def all_at_once() -> list[httpx2.Response]:
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=0)  # a connection each
        async with httpx2.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client) for _ in range(burst)))  # raises on a connection error

    responses = asyncio.run(all_at_once())
    by_status: dict[int, int] = {}
    for resp in responses:
        by_status[resp.status_code] = by_status.get(resp.status_code, 0) + 1
        if resp.status_code == 200:
            assert len(resp.json()["choices"]) == 2
        else:
            assert resp.status_code in (429, 503), resp.text
            assert resp.json()["error"]["code"] == resp.status_code
            assert int(resp.headers["retry-after"]) >= 1
    assert by_status.get(200, 0) > 0
    for status in (429, 503):  # each refusal counted and logged
        assert rejected(tiny.url, status) - before[status] == by_status.get(status, 0)
    assert tiny.log().count("refused POST /v1/completions") >= by_status.get(429, 0) + by_status.get(503, 0)


def test_connections_past_the_cap_get_a_json_503_with_retry_after(tiny):
    host, port = tiny.url.removeprefix("http://").split(":")
    before = rejected(tiny.url, 503)
    idle = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS)]
    try:  # the cap is full (for the header timeout) with connections that sent nothing yet
        resp = httpx2.post(f"{tiny.url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=HTTP_TIMEOUT_S)
    finally:
        for sock in idle:
            sock.close()
    assert_error(resp, 503, f"{MAX_CONNECTIONS} open connections")
    assert int(resp.headers["retry-after"]) >= 1
    assert rejected(tiny.url, 503) - before == 1
    assert httpx2.post(f"{tiny.url}/v1/completions", json={"prompt": [5], "max_tokens": 2},
                       timeout=HTTP_TIMEOUT_S).status_code == 200
