"""The ASGI handler of the inference endpoints: Django's, without the site's middleware.

Under ASGI, Django runs each of the site's (synchronous) middleware hooks through
``sync_to_async``: a hop to another thread and back, twice per middleware, for every request.
The inference endpoints (chat, completions, embeddings, Responses and its stored responses,
models) use none of what they provide (sessions, the logged-in user, messages, CSRF, slash
redirects): they take a Bearer key and answer JSON. So requests to them skip the
chain and keep only the security checks and headers, run in place (they touch no database).
Nor do they get a thread of their own: Django starts one per request (``ThreadSensitiveContext``)
for its synchronous code, which here is only the request signals' receivers (their blocking
work runs on ``gateway.admission``'s threads); those share asgiref's one thread instead.
Everything else goes through the full stack as before.
"""

from __future__ import annotations

import logging
import uuid

from django.core.exceptions import DisallowedHost
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.middleware.security import SecurityMiddleware

from gateway.errors import ApiError, unexpected_error

_host_log = logging.getLogger("django.security.DisallowedHost")  # where Django logs it for the site

# Exact paths, and prefixes, of the endpoints this handler serves (all of them Bearer-key only).
PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/models"})
PREFIXES = ("/v1/models/", "/v1/responses/")


def serves(path: str) -> bool:
    return path in PATHS or path.startswith(PREFIXES)


def _security(get_response):
    """The Host header checked against ALLOWED_HOSTS; SecurityMiddleware's redirect and headers,
    without its thread hops; errors in OpenAI's JSON
    shape, Django's 500 page included; and, as OpenAI does, an ``x-request-id`` on every response
    (an inference request's is its completion id, which its usage record has too)."""
    checks = SecurityMiddleware(get_response)

    async def middleware(request):
        try:
            request.get_host()  # checked against ALLOWED_HOSTS, as CommonMiddleware does for the site
        except DisallowedHost as exc:
            _host_log.warning("%s", exc)
            return ApiError(400, "The request's Host header is not one this server answers to.",
                            code="invalid_host").response()
        response = checks.process_request(request) or await get_response(request)
        if response.status_code == 500 and not response.get("Content-Type", "").startswith("application/json"):
            # A bug (Django logged it): an API client still gets an error it can parse.
            response = unexpected_error().response()
        if "x-request-id" not in response:
            response["x-request-id"] = f"req_{uuid.uuid4().hex}"
        return checks.process_response(request, response)

    return middleware


class ApiHandler(ASGIHandler):
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"the API handler serves HTTP only, not {scope['type']}")
        await self.handle(scope, receive, send)  # no ThreadSensitiveContext (see above)

    def load_middleware(self, is_async=False):
        # The attributes BaseHandler.load_middleware fills from settings.MIDDLEWARE, left empty
        # but for the security checks.
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        inner = convert_exception_to_response(self._get_response_async)
        self._middleware_chain = convert_exception_to_response(_security(inner))
