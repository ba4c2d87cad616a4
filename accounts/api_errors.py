"""DRF errors in OpenAI's shape, for every REST API of the platform.

``{"error": {"message", "type", "param", "code"}}`` with the right status. Each app's exception
handler renders its own domain errors with :func:`error_response` and hands DRF's exceptions
(validation, authentication, throttling, ...) to :func:`drf_error_response`.
"""

from __future__ import annotations

from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

def error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status: every client error is an ``invalid_request_error``
    (401, 403 and 404 too), a 429 a limit on ``requests`` unless the error says otherwise
    (``tokens``, ``insufficient_quota``), and every server error a ``server_error``."""
    if status == 429:
        return "requests"
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_response(status: int, message: str, *, type: str | None = None, param=None, code=None,
                   headers=None) -> Response:
    body = {"error": {"message": message, "type": type or error_type(status),
                      "param": param, "code": code}}
    return Response(body, status=status, headers=headers)


def drf_error_response(exc: drf_exceptions.APIException) -> Response:
    """DRF's exception as one message; a field error names the field in ``param``."""
    detail = exc.detail
    if isinstance(detail, dict):
        param, messages = next(iter(detail.items())) if detail else (None, ["invalid request"])
        message = str(messages[0] if isinstance(messages, list) else messages)
    elif isinstance(detail, list):
        param, message = None, str(detail[0]) if detail else "invalid request"
    else:
        param, message = None, str(detail)
    codes = exc.get_codes()
    code = codes if isinstance(codes, str) else None
    if isinstance(exc, drf_exceptions.NotAuthenticated):
        code = "invalid_api_key"
    headers = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    if getattr(exc, "wait", None):
        headers["Retry-After"] = str(int(exc.wait))
    return error_response(exc.status_code, message, param=param, code=code, headers=headers)
