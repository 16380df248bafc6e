"""GET /v1/files/{id}/content racing DELETE of the same file: the download is the whole file or a 404,
never a 500 nor a Content-Length followed by nothing. The Batch API's routes in-process (no engine),
over a real store in a temporary directory; the delete is made at the moment the download's headers
go out, by a hook on the ASGI send, not by timing."""

from __future__ import annotations

import asyncio

import httpx2
from fastapi import FastAPI

from goodserve.server.batch_routes import batch_router
from goodserve.server.batch_store import BatchStore
from goodserve.server.errors import install_error_handlers

CONTENT = b"".join(b'{"custom_id": "line-%d"}\n' % i for i in range(20_000))  # ~450 KB: several chunks


class DeleteWhenHeadersGo:
    """The app, with DELETE /v1/files/{id} sent through it when a download's headers go out."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.delete_answers: list[int] = []

    async def __call__(self, scope, receive, send):
        async def send_then_delete(message):
            if message["type"] == "http.response.start" and scope["path"].endswith("/content"):
                file_id = scope["path"].split("/")[3]
                async with client_of(self.app) as client:
                    self.delete_answers.append((await client.delete(f"/v1/files/{file_id}")).status_code)
            await send(message)

        await self.app(scope, receive, send_then_delete)


def client_of(app) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://server")


def files_app(store: BatchStore) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app, on_error=lambda status: None)
    app.include_router(batch_router(store, runner=None, max_file_bytes=len(CONTENT), allow_unknown_fields=False,
                                    ensure_accepting=lambda: None))
    return app


async def upload(client: httpx2.AsyncClient) -> str:
    response = await client.post("/v1/files", files={"file": ("lines.jsonl", CONTENT)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_a_delete_while_the_download_begins_leaves_the_download_whole(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        try:
            app = files_app(store)
            racing = DeleteWhenHeadersGo(app)
            async with client_of(app) as client, client_of(racing) as racing_client:
                file_id = await upload(client)
                download = await racing_client.get(f"/v1/files/{file_id}/content")
                assert racing.delete_answers == [200]  # the delete went through, mid-download
                assert download.status_code == 200
                assert int(download.headers["content-length"]) == len(CONTENT)
                assert download.content == CONTENT
                assert (await client.get(f"/v1/files/{file_id}/content")).status_code == 404
                assert not any(store.files_dir.iterdir())  # the bytes went with the last reader
        finally:
            store.close()
    asyncio.run(main())


def test_a_file_deleted_before_its_download_is_a_404(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        try:
            async with client_of(files_app(store)) as client:
                file_id = await upload(client)
                assert (await client.delete(f"/v1/files/{file_id}")).status_code == 200
                gone = await client.get(f"/v1/files/{file_id}/content")
                assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
        finally:
            store.close()
    asyncio.run(main())
