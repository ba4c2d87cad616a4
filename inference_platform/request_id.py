"""Every ``/v1/`` response names itself in ``x-request-id``, as OpenAI's do (the ``openai``
package shows it as ``_request_id``): an inference response by its completion id, which the
gateway sets and its usage record carries, any other by a new one."""

from __future__ import annotations

import secrets

from django.utils.deprecation import MiddlewareMixin

HEADER = "x-request-id"


def new_request_id() -> str:
    """The id of a response that is no inference's."""
    return f"req_{secrets.token_hex(16)}"


class RequestIdMiddleware(MiddlewareMixin):  # the mixin: sync and async, like Django's own
    def process_response(self, request, response):
        if request.path.startswith("/v1/") and HEADER not in response:
            response[HEADER] = new_request_id()
        return response
