"""Errors of the accounts app. Each carries a message fit to show the API's caller."""

from __future__ import annotations


class AccountsError(Exception):
    """Base class: ``message`` is safe to show to the user."""

    def __init__(self, message: str | None = None):
        self.message = message or self.default_message
        super().__init__(self.message)

    default_message = "account error"


class ApiKeyError(AccountsError):
    """The request's API key cannot be used. ``code`` follows OpenAI's error codes."""

    code = "invalid_api_key"
    default_message = "Invalid API key."


class InvalidApiKey(ApiKeyError):
    """Missing, malformed or unknown key (the message never says which part was wrong)."""

    default_message = "Incorrect API key provided. You can create a key in the dashboard under API keys."


class MissingApiKey(InvalidApiKey):
    default_message = (
        "You didn't provide an API key. Pass it in the Authorization header: 'Authorization: Bearer sk-...'."
    )


class ExpiredApiKey(ApiKeyError):
    default_message = "This API key has expired. Create a new key in the dashboard."


class RevokedApiKey(ApiKeyError):
    default_message = "This API key has been revoked. Create a new key in the dashboard."


class DeactivatedApiKey(ApiKeyError):
    """The key's creator is deactivated: it works again if they are reactivated (not revoked)."""

    default_message = ("This API key belongs to a deactivated user account and cannot be used. "
                       "Ask an owner or admin of the organization for a key.")


class InvalidInput(AccountsError):
    """A service refused its arguments; ``field`` names the offending one."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
