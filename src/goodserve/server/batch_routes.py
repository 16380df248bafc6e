"""The Batch API's routes, OpenAI's shapes: /v1/files (upload, list, retrieve, content, delete) and
/v1/batches (create, retrieve, list, cancel). State lives in batch_store.py; jobs run in
batch_runner.py."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Query, Request

from goodserve.errors import GoodserveError, InvalidRequestError
from goodserve.server.batch_lines import ENDPOINTS
from goodserve.server.batch_runner import BatchRunner
from goodserve.server.batch_store import BatchStore
from goodserve.server.contract import check_fields
from goodserve.server.errors import RequestTooLargeError
from goodserve.server.multipart import read_form
from goodserve.server.open_file_response import OpenFileResponse
from goodserve.server.protocol import CreateBatchRequest

COMPLETION_WINDOW_S = {"24h": 24 * 3600}  # OpenAI's only window
_UPLOAD_SCHEMA = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": ["batch"]}},
}}}}}


class NotFoundError(GoodserveError):
    http_status = 404
    error_type = "not_found_error"


def batch_router(store: BatchStore, runner: BatchRunner, max_file_bytes: int, allow_unknown_fields: bool,
                 ensure_accepting) -> APIRouter:
    router = APIRouter(prefix="/v1")

    async def file_or_404(file_id: str) -> dict:
        file = await store.get_file(file_id)
        if file is None:
            raise NotFoundError(f"no file with id '{file_id}'")
        return _file_object(file)

    async def batch_or_404(batch_id: str) -> dict:
        batch = await store.get_batch(batch_id)
        if batch is None:
            raise NotFoundError(f"no batch with id '{batch_id}'")
        return batch

    @router.post("/files", openapi_extra=_UPLOAD_SCHEMA)  # read by hand (multipart.py): described here
    async def upload_file(request: Request) -> dict:
        ensure_accepting()
        file_id = f"file-{uuid.uuid4().hex}"
        partial = store.file_path(file_id).with_suffix(".upload")
        try:
            form = await read_form(request.stream(), request.headers.get("content-type", ""), partial)
            if "file" not in form or form["file"].filename is None:
                raise InvalidRequestError("the form needs a 'file' field holding the file")
            purpose = form["purpose"].data.decode() if "purpose" in form else None
            if purpose != "batch":
                raise InvalidRequestError(f"purpose must be 'batch' (the only purpose served here), got {purpose!r}")
            size = form["file"].size
            if size > max_file_bytes:
                raise RequestTooLargeError(f"the file has {size} bytes, more than this server takes "
                                           f"(--batch-max-file-bytes {max_file_bytes})")
            file = {"id": file_id, "filename": form["file"].filename, "purpose": purpose, "bytes": size,
                    "created_at": int(time.time())}
            await store.add_file_from(file, partial)
        finally:
            partial.unlink(missing_ok=True)  # moved into place, or not kept
        return _file_object(file)

    @router.get("/files")
    async def list_files() -> dict:
        return {"object": "list", "data": [_file_object(f) for f in await store.list_files()], "has_more": False}

    @router.get("/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict:
        return await file_or_404(file_id)

    @router.get("/files/{file_id}/content")
    async def file_content(file_id: str) -> OpenFileResponse:
        handle = await store.open_file(file_id)  # opened now: a delete from here on cannot cut the answer
        if handle is None:
            raise NotFoundError(f"no file with id '{file_id}'")
        return OpenFileResponse(handle, media_type="application/jsonl")

    @router.delete("/files/{file_id}")
    async def delete_file(file_id: str) -> dict:
        await file_or_404(file_id)
        if await store.file_in_use(file_id):
            raise InvalidRequestError(f"file '{file_id}' is the input of an unfinished batch: cancel it first")
        await store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.post("/batches")
    async def create_batch(body: CreateBatchRequest) -> dict:
        ensure_accepting()
        check_fields(body, CreateBatchRequest.unsupported, allow_unknown_fields)
        if body.endpoint not in ENDPOINTS:
            raise InvalidRequestError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got '{body.endpoint}'")
        if body.completion_window not in COMPLETION_WINDOW_S:
            raise InvalidRequestError(f"completion_window must be one of {', '.join(COMPLETION_WINDOW_S)}")
        file = await file_or_404(body.input_file_id)
        if file["purpose"] != "batch":
            raise InvalidRequestError(f"file '{file['id']}' has purpose '{file['purpose']}', not 'batch'")
        now = int(time.time())
        batch = {
            "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": body.endpoint, "errors": None,
            "input_file_id": body.input_file_id, "completion_window": body.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S[body.completion_window],
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata,
        }
        await store.add_batch(batch)
        runner.start(batch["id"])
        return batch

    @router.get("/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict:
        return await batch_or_404(batch_id)

    @router.get("/batches")
    async def list_batches(limit: int = Query(default=20, ge=1, le=100), after: str | None = None) -> dict:
        batches = await store.list_batches(limit + 1, after)  # one more says whether a next page exists
        page = batches[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit}

    @router.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict:
        batch = await batch_or_404(batch_id)
        if batch["status"] not in ("validating", "in_progress", "cancelling", "cancelled"):
            raise InvalidRequestError(f"batch '{batch_id}' is {batch['status']}: it can no longer be cancelled")
        return await runner.cancel(batch_id)

    return router


def _file_object(file: dict) -> dict:
    return {**file, "object": "file", "status": "processed", "expires_at": None, "status_details": None}

