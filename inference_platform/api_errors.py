"""The REST API's unexpected errors in OpenAI's JSON shape.

An exception no view handled reaches Django, which answers with its HTML 500 page (and, with
DEBUG on, a traceback). A client of ``/v1/`` gets JSON it can parse instead; Django's logger still
records the traceback. (The inference endpoints have their own handler: ``api_handler``.)
"""

from __future__ import annotations

import logging

from django.utils.deprecation import MiddlewareMixin

from gateway.errors import unexpected_error

log = logging.getLogger("django.request")


class ApiErrorsMiddleware(MiddlewareMixin):  # the mixin: sync and async, like Django's own
    def process_exception(self, request, exception):
        if not request.path.startswith("/v1/"):
            return None  # the dashboard keeps Django's error pages
        log.error("Internal Server Error: %s", request.path, exc_info=exception, extra={"status_code": 500})
        return unexpected_error().response()
