"""Errors of the dashboard's services; ``message`` is fit to show the user, ``field`` names the
form field it concerns (None: the whole form)."""

from __future__ import annotations


class DashboardError(Exception):
    def __init__(self, message: str, *, field: str | None = None):
        self.message = message
        self.field = field
        super().__init__(message)


class NotAllowed(DashboardError):
    """The user's role in the organization does not allow this."""


class InvalidInvitation(DashboardError):
    """The invitation link is unknown, used, revoked or expired."""


class SignUpClosed(DashboardError):
    """Sign-up without an invitation, where the operator closed it (``SIGNUP_OPEN=false``)."""
