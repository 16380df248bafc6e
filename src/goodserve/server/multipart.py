"""multipart/form-data bodies (`POST /v1/files`), read as they stream in: the file field goes to a file
on disk a chunk at a time, so an upload of 100 MB costs the server a chunk of memory, not the file
(read whole, three 99 MB uploads took it from 311 to 992 MB). The other fields are small and kept in
memory, up to MAX_FIELD_BYTES. This spares the server a dependency (python-multipart) for one route.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from email.message import Message
from email.parser import BytesHeaderParser
from pathlib import Path
from typing import BinaryIO

from goodserve.errors import InvalidRequestError

MAX_FIELD_BYTES = 64 << 10  # a field other than a file (purpose) and a part's headers


class FormField:
    def __init__(self, headers: Message):
        self.name = headers.get_param("name", header="content-disposition")
        self.filename = headers.get_filename()
        self.data = b""  # a field's value; a file's goes to disk
        self.size = 0


def _boundary(content_type: str) -> bytes:
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not boundary:
        raise InvalidRequestError("the body must be multipart/form-data with a boundary")
    return boundary.encode()


async def read_form(chunks: AsyncIterator[bytes], content_type: str, file_path: Path) -> dict[str, FormField]:
    """The fields of a multipart/form-data body by name; the (one) field holding a file is written to
    file_path as it arrives."""
    # Every delimiter follows a line break; with one put before the body, the first does too.
    delimiter = b"\r\n--" + _boundary(content_type)
    keep = len(delimiter) - 1  # bytes that may be the start of a delimiter split across chunks
    fields: dict[str, FormField] = {}
    buffer, state, field, sink = b"\r\n", "preamble", None, None
    with open(file_path, "wb") as file:
        async for chunk in chunks:
            buffer += chunk
            while True:
                if state in ("preamble", "data"):
                    found = buffer.find(delimiter)
                    if found < 0:
                        await _write(sink, field, buffer[:max(0, len(buffer) - keep)])
                        buffer = buffer[max(0, len(buffer) - keep):]
                        break
                    await _write(sink, field, buffer[:found])
                    buffer, state = buffer[found + len(delimiter):], "delimiter"
                elif state == "delimiter":
                    if len(buffer) < 2:
                        break
                    if buffer.startswith(b"--"):
                        return _checked(fields)
                    if not buffer.startswith(b"\r\n"):
                        raise InvalidRequestError("a multipart delimiter is not followed by a line break")
                    buffer, state = buffer[2:], "headers"
                else:  # headers
                    end = buffer.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buffer) > MAX_FIELD_BYTES:
                            raise InvalidRequestError("a multipart field's headers have no end")
                        break
                    field = FormField(BytesHeaderParser().parsebytes(buffer[:end]))
                    if field.name:
                        fields[field.name] = field
                    sink = file if field.filename is not None else None
                    buffer, state = buffer[end + 4:], "data"
    raise InvalidRequestError("the multipart body ends before its closing delimiter")


async def _write(sink: BinaryIO | None, field: FormField | None, data: bytes) -> None:
    if field is None or not data:  # the preamble before the first field is ignored
        return
    field.size += len(data)
    if sink is not None:
        await asyncio.to_thread(sink.write, data)
    elif field.size > MAX_FIELD_BYTES:
        raise InvalidRequestError(f"the form field {field.name!r} has more than {MAX_FIELD_BYTES} bytes")
    else:
        field.data += data


def _checked(fields: dict[str, FormField]) -> dict[str, FormField]:
    if sum(f.filename is not None for f in fields.values()) > 1:
        raise InvalidRequestError("the form holds more than one file")
    return fields

