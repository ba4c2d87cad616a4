"""What every dashboard view shares: the organization requirement and the operator check."""

from __future__ import annotations

from functools import wraps
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import redirect, render, resolve_url
from django.utils.http import url_has_allowed_host_and_scheme, urlencode

from ..organizations import current_organization
from ..selectors import role_in


def _login_required(view):
    """Django's login_required, except that an htmx request (a poll, a partial) whose session
    ended sends the whole page to the login form instead of swapping the form into a fragment."""
    plain = login_required(view)

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if is_htmx(request) and not request.user.is_authenticated:
            page = request.headers.get("HX-Current-URL", "")
            target = resolve_url(settings.LOGIN_URL)
            if page and url_has_allowed_host_and_scheme(page, allowed_hosts={request.get_host()}):
                parts = urlsplit(page)
                target = f"{target}?{urlencode({'next': parts.path + (f'?{parts.query}' if parts.query else '')})}"
            response = HttpResponse(status=204)
            response["HX-Redirect"] = target
            return response
        return plain(request, *args, **kwargs)

    return wrapped


def organization_required(view):
    """Login, then a current organization (else the "create your organization" page). Sets
    ``request.organization`` and ``request.role``."""

    @_login_required
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        organization = current_organization(request)
        if organization is None:
            messages.info(request, "Create an organization to start: it owns your deployments, keys and credit.")
            return redirect("organization-new")
        request.organization = organization
        request.role = role_in(user=request.user, organization=organization)
        return view(request, *args, **kwargs)

    return wrapped


def staff_required(view):
    """Operator pages: staff only (others get 403)."""

    @_login_required
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not request.user.is_staff:
            return forbidden(request, "This page is for the platform's operators.")
        return view(request, *args, **kwargs)

    return wrapped


def forbidden(request, reason: str) -> HttpResponse:
    """The 403 page, saying why. Returned, not raised as PermissionDenied, which Django logs with
    a traceback: a refusal is no bug (Django still logs the 403, as a warning)."""
    return render(request, "403.html", {"exception": reason}, status=403)


def safe_next(request, fallback: str = "/") -> str:
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                                    require_https=request.is_secure()):
        return target
    return fallback


def is_htmx(request) -> bool:
    return request.headers.get("HX-Request") == "true"
