"""Absolute links for emails: under SITE_URL when it is set, since a request's Host header is its
client's to choose (Django's ALLOWED_HOSTS check ignores the port), else the request's own."""

from __future__ import annotations

from urllib.parse import urlsplit

from django.conf import settings


def absolute_url(request, path: str) -> str:
    if settings.SITE_URL:
        return settings.SITE_URL.rstrip("/") + path
    return request.build_absolute_uri(path)


def site_override() -> dict:
    """The arguments that make Django's password-reset email link under SITE_URL (none without it)."""
    if not settings.SITE_URL:
        return {}
    parts = urlsplit(settings.SITE_URL)
    return {"domain_override": parts.netloc + parts.path.rstrip("/"), "use_https": parts.scheme == "https"}
