"""The dashboard's own assets, served by the app (``inference-platform up`` serves everything from
one ASGI process): Django's static view, its file sent whole. Django streams a file through a
synchronous iterator, which under ASGI costs a thread hop per chunk and a warning in the log; the
assets are small (the largest, Chart.js, about 200 KB) and cached by browsers."""

from __future__ import annotations

from django.contrib.staticfiles.views import serve
from django.http import HttpResponse


def serve_whole(request, path: str):
    response = serve(request, path, insecure=True)
    if not response.streaming:  # a 304
        return response
    try:
        whole = HttpResponse(b"".join(response.streaming_content), status=response.status_code)
    finally:
        response.close()
    for header, value in response.headers.items():
        whole[header] = value
    return whole
