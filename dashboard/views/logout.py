"""Logging out: a POST (CSRF-checked), as Django's LogoutView wants; a GET, such as a typed or
bookmarked /logout/, gets a page asking to confirm instead of a blank 405."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

_log_out = auth_views.LogoutView.as_view()


@require_http_methods(["GET", "POST"])
def logout(request):
    if request.method == "POST":
        return _log_out(request)
    if not request.user.is_authenticated:
        return redirect("login")
    return render(request, "registration/logout_confirm.html")
