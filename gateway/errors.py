"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import re

from django.http import JsonResponse

from accounts.api_errors import error_type, logged_as_expected

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Raised anywhere in the gateway; rendered once, in OpenAI's shape, with its status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None, expected: bool = False):
        super().__init__(message)
        # A 5xx that is no failure of the platform's (a deployment its owner stopped, or one busier
        # than its replicas, like a 429): logged as a warning, not as Django's ERROR for every
        # 5xx, which alerting on errors would page for.
        self.expected = expected
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(self.status)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        if self.expected:
            logged_as_expected(response, code=self.code, message=self.message, logger=log)
        return response


def invalid(param: str | None, message: str, *, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code or ("invalid_value" if param else None))


def json_type(value) -> str:
    """What a JSON value is, in words: for a message saying what was sent instead."""
    return ("null" if value is None else "a boolean" if isinstance(value, bool) else "a number"
            if isinstance(value, (int, float)) else "a string" if isinstance(value, str)
            else "an object" if isinstance(value, dict) else "an array")


def json_object(body) -> dict:
    """A request body, which must be a JSON object: anything else is a 400 saying what it is."""
    if isinstance(body, dict):
        return body
    raise ApiError(400, f"The request body must be a JSON object, not {json_type(body)}.", code="invalid_type")


def unexpected_error() -> ApiError:
    """What a client gets for a bug (the traceback goes to the log, not to the client)."""
    return ApiError(500, "The server hit an unexpected error; it is logged. Retry, or tell the operator.",
                    code="internal_error")


# JSON may escape half of a UTF-16 pair ("\ud83d"), e.g. from a string cut inside an emoji: not text.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def text_only(text: str, param: str) -> str:
    """``text``, or a 400 naming ``param`` if it holds what no text encoding can carry."""
    found = LONE_SURROGATE.search(text)
    if found:
        raise invalid(param, f"{param} holds an unpaired UTF-16 surrogate (\\u{ord(found.group()):04x}) at "
                             f"character {found.start()}, which is not text: was a string cut inside a "
                             "character (an emoji)?")
    return text
