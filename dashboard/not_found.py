"""A dashboard page's 404 as the dashboard's own page, saying what was not found.

Django answers an ``Http404`` raised by a view with its debug page in debug mode (the default of
``up``): a list of the site's URL patterns, which tells a user nothing and looks broken. A view
of the dashboard that did not find its object (gone, expired, or another organization's) gets
the styled page with the view's reason, in either mode. A path no URL matches keeps Django's
handling (its debug page lists the patterns a developer may have meant).
"""

from __future__ import annotations

from django.http import Http404
from django.shortcuts import render
from django.utils.deprecation import MiddlewareMixin

# The views whose 404s are the dashboard's (the billing page lives in billing.views).
_DASHBOARD_VIEWS = ("dashboard.", "billing.views")


class NotFoundPageMiddleware(MiddlewareMixin):
    def process_exception(self, request, exception):
        match = request.resolver_match
        if not isinstance(exception, Http404) or match is None or not match.func.__module__.startswith(_DASHBOARD_VIEWS):
            return None
        reason = exception.args[0] if exception.args and isinstance(exception.args[0], str) else ""
        return render(request, "404.html", {"reason": reason}, status=404)
