"""POST /v1/files reads its multipart body as it streams in and writes the file to disk a chunk at a
time: the parser against the whole-body one it replaced (email's own MIME parser as the reference),
however the body is cut into chunks, and an upload through the app in-process whose Python memory
stays a small fraction of the file (tracemalloc counts every bytes object the server makes)."""

from __future__ import annotations

import asyncio
import email
import json
import tracemalloc

import httpx2
import pytest

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.errors import InvalidRequestError
from goodserve.server.app import ServerConfig, build_app
from goodserve.server.multipart import read_form

BOUNDARY = "b0undary"
TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form_body(content: bytes, filename: str = "in.jsonl", purpose: str = "batch") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()


def reference(body: bytes) -> dict[str, bytes]:
    """The fields as the standard library's MIME parser reads the same body."""
    message = email.message_from_bytes(f"Content-Type: {TYPE}\r\n\r\n".encode() + body)
    return {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
            for part in message.get_payload()}


async def chunked(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


# a file holding what looks like delimiters: a line break and dashes, the boundary without its dashes
TRICKY = b'{"a": "\r\n-"}\n\r\n--b0undar\r\n' + BOUNDARY.encode() + b"\n" * 3 + b"x" * 1000


@pytest.mark.parametrize("chunk", [1, 2, 7, 13, 4096, 1 << 20])
def test_fields_read_in_any_chunks_equal_the_mime_parsers(tmp_path, chunk):
    body = form_body(TRICKY)
    path = tmp_path / "upload"
    form = asyncio.run(read_form(chunked(body, chunk), TYPE, path))
    expected = reference(body)
    assert path.read_bytes() == expected["file"] and form["file"].size == len(expected["file"])
    assert form["file"].filename == "in.jsonl"
    assert form["purpose"].data == expected["purpose"] == b"batch"


@pytest.mark.parametrize("body, words", [
    (form_body(b"x")[:-10], "ends before"),
    (form_body(b"x", purpose="p" * 70_000), "more than"),
])
def test_a_malformed_form_is_a_400(tmp_path, body, words):
    with pytest.raises(InvalidRequestError, match=words):
        asyncio.run(read_form(chunked(body, 4096), TYPE, tmp_path / "upload"))


def test_an_upload_streams_to_disk_through_the_app(tmp_path):
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": [1, 2], "max_tokens": 1}}).encode() + b"\n"
    content = line * (24_000_000 // len(line))  # ~24 MB
    app = build_app(AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=16)),
                    ServerConfig(data_dir=str(tmp_path / "data")))
    body = form_body(content)

    async def upload() -> httpx2.Response:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://goodserve") as client:
            return await client.post("/v1/files", content=chunked(body, 64 << 10),
                                     headers={"content-type": TYPE, "content-length": str(len(body))})

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        reply = asyncio.run(upload())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply.status_code == 200, reply.text
    assert reply.json()["bytes"] == len(content)
    assert (tmp_path / "data" / "files" / reply.json()["id"]).read_bytes() == content
    assert peak < len(content) // 4, peak  # read whole, the body alone was the file's size (and copied twice)
