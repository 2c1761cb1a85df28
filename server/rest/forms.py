"""Multipart form bodies of TorchServe's prediction API (`curl -F data=@image.jpg`): their fields
by name, read by Starlette's parser (python-multipart) within the server's limits."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from scriptserve.server.errors import InvalidInput
from scriptserve.server.settings import ServerSettings


async def form_fields(body: bytes, headers: Headers, settings: ServerSettings) -> dict[str, bytes]:
    """The fields of a multipart body, each as bytes (a repeated name keeps its last value);
    InvalidInput when the body does not read as a form within `max_multipart_*`."""

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    parser = MultiPartParser(
        headers,
        stream(),
        max_files=settings.max_multipart_files,
        max_fields=settings.max_multipart_fields,
        max_part_size=settings.max_multipart_part_bytes,
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise InvalidInput(f"the multipart body cannot be read: {exc.message}") from None
    fields: dict[str, bytes] = {}
    try:
        for key, value in form.multi_items():
            fields[key] = await value.read() if isinstance(value, UploadFile) else value.encode()
    finally:
        await form.close()
    return fields
