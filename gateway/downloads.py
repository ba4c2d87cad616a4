"""A file's content as a download, streamed a chunk at a time. The chunks come from an async
iterator: under ASGI, Django reads a synchronous one whole into memory before it sends a byte."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.http import StreamingHttpResponse

from . import selectors
from .models import UploadedFile


def download(found: UploadedFile, *, attachment: bool = False) -> StreamingHttpResponse:
    """``found``'s bytes (a file deleted meanwhile ends early: short of its Content-Length)."""
    response = StreamingHttpResponse(_chunks(found.pk), content_type="application/jsonl")
    response["Content-Length"] = str(found.size)
    if attachment:
        response["Content-Disposition"] = f'attachment; filename="{found.pk}.jsonl"'
    return response


async def _chunks(file_id: str):
    index = 0
    while (data := await sync_to_async(selectors.file_chunk)(file_id=file_id, index=index)) is not None:
        yield data
        index += 1
