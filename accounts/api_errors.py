"""DRF errors in OpenAI's shape, for every REST API of the platform.

``{"error": {"message", "type", "param", "code"}}`` with the right status. Each app's exception
handler renders its own domain errors with :func:`error_response` and hands DRF's exceptions
(validation, authentication, throttling, ...) to :func:`drf_error_response`.
"""

from __future__ import annotations

import logging

from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

def error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status: every client error is an ``invalid_request_error``
    (401, 403 and 404 too), a 429 a limit on ``requests`` unless the error says otherwise
    (``tokens``, ``insufficient_quota``), and every server error a ``server_error``."""
    if status == 429:
        return "requests"
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def logged_as_expected(response, *, code, message: str, logger: logging.Logger):
    """``response``, a 5xx that is no failure of the platform's (load, or the platform as its
    operator set it up), logged as a warning instead of Django's ERROR for every 5xx, which
    alerting on errors would page for."""
    logger.warning("%s %s: %s", response.status_code, code, message)
    response._has_been_logged = True  # (what Django's request logging reads)
    return response


def error_response(status: int, message: str, *, type: str | None = None, param=None, code=None,
                   headers=None) -> Response:
    body = {"error": {"message": message, "type": type or error_type(status),
                      "param": param, "code": code}}
    return Response(body, status=status, headers=headers)


# DRF's codes for a field, as OpenAI names them.
_FIELD_CODES = {"required": "missing_required_parameter", "invalid": "invalid_value", "null": "invalid_value"}


def drf_error_response(exc: drf_exceptions.APIException, context: dict | None = None) -> Response:
    """DRF's exception as one message; a field error names the field in ``param``, and its code.
    A method the view does not take says which ones it does (``context``: the handler's)."""
    detail = exc.detail
    if isinstance(detail, dict):
        param, messages = next(iter(detail.items())) if detail else (None, ["invalid request"])
        first = messages[0] if isinstance(messages, list) and messages else messages
        message = str(first)
        field_code = getattr(first, "code", None)
        code = _FIELD_CODES.get(field_code, field_code) if param is not None else None
    elif isinstance(detail, list):
        param, message = None, str(detail[0]) if detail else "invalid request"
        code = None
    else:
        param, message = None, str(detail)
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else None
    if isinstance(exc, drf_exceptions.NotAuthenticated):
        code = "invalid_api_key"
    view, request = (context or {}).get("view"), (context or {}).get("request")
    if isinstance(exc, drf_exceptions.MethodNotAllowed) and view is not None and request is not None:
        allowed = [m for m in view.allowed_methods if m not in ("OPTIONS", "HEAD")]
        message = f"Use {' or '.join(allowed)} for {request.path}." if allowed else message
    headers = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    if getattr(exc, "wait", None):
        headers["Retry-After"] = str(int(exc.wait))
    return error_response(exc.status_code, message, param=param, code=code, headers=headers)
