"""A download served from a file handle opened before the response began."""

from __future__ import annotations

import functools
import os
from typing import BinaryIO

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

CHUNK_BYTES = 64 << 10


class OpenFileResponse(StreamingResponse):
    """The whole file the handle holds, its length announced from the handle itself. A delete that
    races the download unlinks the name, not the open file (POSIX), so the client gets every byte
    announced, never a Content-Length followed by nothing (as a response that opens by path after
    sending its headers does)."""

    def __init__(self, handle: BinaryIO, media_type: str):
        size = os.fstat(handle.fileno()).st_size
        super().__init__(iter(functools.partial(handle.read, CHUNK_BYTES), b""), media_type=media_type,
                         headers={"content-length": str(size)})
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # also when the client left before the body began
            self.handle.close()
