"""multipart/form-data bodies (`POST /v1/files`), parsed whole: the body is already bounded by
--batch-max-file-bytes, and this spares the server a dependency (python-multipart) for one route."""

from __future__ import annotations

from email.message import Message
from email.parser import BytesHeaderParser

from goodserve.errors import InvalidRequestError


class FormField:
    def __init__(self, headers: Message, data: bytes):
        self.name = headers.get_param("name", header="content-disposition")
        self.filename = headers.get_filename()
        self.data = data


def parse_form(body: bytes, content_type: str) -> dict[str, FormField]:
    """The fields of a multipart/form-data body by name."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not boundary:
        raise InvalidRequestError("the body must be multipart/form-data with a boundary")
    fields = {}
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):  # the closing delimiter
            break
        head, separator, data = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not separator:
            raise InvalidRequestError("a multipart field has no header/body separator")
        field = FormField(BytesHeaderParser().parsebytes(head), data.removesuffix(b"\r\n"))
        if field.name:
            fields[field.name] = field
    return fields
