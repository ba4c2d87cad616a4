"""The 403 page: true for every refusal (not only the operator pages), with the view's reason when
it gives one (Django's handler passes the PermissionDenied's message to the template as
``exception``)."""

from __future__ import annotations

import re

from django.core.exceptions import PermissionDenied
from django.test import RequestFactory
from django.views.defaults import permission_denied


def _reason(html: str) -> str:
    return re.search(r'id="denied-reason">(.*?)</p>', html, flags=re.DOTALL).group(1)


def _page(user, exception: PermissionDenied) -> str:
    """The page Django's 403 handler renders for ``exception``, as for a view that raised it."""
    request = RequestFactory().get("/somewhere/")
    request.user, request.session = user, {}
    response = permission_denied(request, exception)
    assert response.status_code == 403
    return response.content.decode()


def test_an_operator_page_says_it_is_for_operators(ada, caplog):
    with caplog.at_level("WARNING", logger="django.request"):
        response = ada.get("/operator/fleet/")
    assert response.status_code == 403
    assert _reason(response.content.decode()) == "This page is for the platform&#x27;s operators."
    [record] = [r for r in caplog.records if r.name == "django.request"]
    assert record.levelname == "WARNING" and record.exc_info is None  # a refusal, not a bug: no traceback


def test_a_refusal_with_a_reason_shows_that_reason_and_not_the_operators(acme):
    user, _ = acme
    html = _page(user, PermissionDenied("Only owners and admins can manage <this> key."))
    assert _reason(html) == "Only owners and admins can manage &lt;this&gt; key."  # escaped, as any text
    assert "operator" not in html


def test_a_refusal_without_a_reason_is_generic(acme):
    user, _ = acme
    html = _page(user, PermissionDenied())
    assert "your role in this organization" in _reason(html)
    assert "operator" not in html
