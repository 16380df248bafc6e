"""--stream-interval N: a streamed choice's first token comes alone (its time to first token), the
rest in chunks of at least N tokens and the last; the tokens and text are those of the whole
response. A real server on dummy:tiny (prompts as token ids; logprobs name each chunk's tokens),
read through the official openai client."""

from __future__ import annotations

import openai
import pytest

from helpers import InProcessServer


MODEL = "dummy:tiny"
INTERVAL = 4
REQUEST = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=17, logprobs=1, temperature=0,
               extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client():
    server = InProcessServer(["--model", MODEL, "--stream-interval", str(INTERVAL), "--max-model-len", "256"])
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    finally:
        server.stop()


def chunk_tokens(client, n: int) -> dict[int, list[list[str]]]:
    """Per choice, the tokens of each streamed chunk that carried any."""
    chunks: dict[int, list[list[str]]] = {}
    for chunk in client.completions.create(stream=True, n=n, **REQUEST):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.tokens:
                chunks.setdefault(choice.index, []).append(choice.logprobs.tokens)
    return chunks


@pytest.mark.parametrize("n", [1, 2])
def test_chunks_hold_the_interval_after_a_lone_first_token(client, n):
    whole = client.completions.create(n=n, **REQUEST)
    streamed = chunk_tokens(client, n)
    assert sorted(streamed) == list(range(n))
    for choice in whole.choices:
        chunks = streamed[choice.index]
        assert [t for chunk in chunks for t in chunk] == choice.logprobs.tokens  # 17 tokens, in order
        sizes = [len(chunk) for chunk in chunks]
        assert sizes[0] == 1 and all(size >= INTERVAL for size in sizes[1:-1]) and sum(sizes) == 17
        assert len(sizes) <= 2 + (17 - 1) // INTERVAL  # not one a token


def test_stream_interval_must_be_positive(capsys):
    from goodserve.cli import main

    assert main(["serve", "--model", MODEL, "--stream-interval", "0"]) != 0
    assert "--stream-interval" in capsys.readouterr().err
