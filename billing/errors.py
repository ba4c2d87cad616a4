"""Errors of the billing app. Each carries a message fit to show the API's caller and the fields of
OpenAI's error shape (``status``, ``type``, ``code``, ``param``), so a view renders it unchanged."""

from __future__ import annotations


class BillingError(Exception):
    """Base class: ``message`` is safe to show to the user."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None
    default_message = "billing error"
    # A 5xx that is the platform as its operator set it up, not a failure: logged as a warning
    # (``accounts.api_errors.logged_as_expected``).
    expected = False

    def __init__(self, message: str | None = None, *, code: str | None = None, param: str | None = None):
        self.message = message or self.default_message
        if code is not None:
            self.code = code
        self.param = param
        super().__init__(self.message)

    def as_error(self) -> dict:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class QuotaExceeded(BillingError):
    """The organization (or the key) may not start another request: no credit left or a spend
    limit reached. The gateway answers 429 like OpenAI's ``insufficient_quota``."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"
    default_message = "You exceeded your current quota. Top up your credit balance in the dashboard."


class InvalidUsageEvent(BillingError, ValueError):
    """A usage event that does not match :class:`billing.events.UsageEvent`; ``param`` names the field.

    Permanent: redelivering the same event cannot fix it, so the task does not retry it."""

    code = "invalid_usage_event"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}", param=field)
        self.field = field


class UnknownModel(BillingError):
    """A usage event names a model the catalog does not have, so no price applies to it."""

    code = "model_not_found"


class InvalidParameter(BillingError):
    """A report or top-up parameter out of range; ``param`` names it."""

    code = "invalid_value"

    def __init__(self, param: str, message: str):
        super().__init__(message, param=param)


class NotAllowed(BillingError):
    """The user's role in the organization does not allow this change."""

    status = 403
    code = "insufficient_role"
    default_message = "Your role in this organization does not allow this."


class CardDeclined(BillingError):
    """The card was refused (or could not be read); the message says why, fit to show."""

    status = 402
    code = "card_declined"
    default_message = "Your card was declined."

    def __init__(self, message: str | None = None):
        super().__init__(message, param="card")


class PaymentsNotConfigured(BillingError):
    status = 503
    type = "server_error"
    code = "payments_not_configured"
    expected = True
    default_message = "Payments are not configured on this platform (STRIPE_SECRET_KEY is unset)."


class PaymentProviderError(BillingError):
    """Stripe refused a call or could not be reached."""

    status = 502
    type = "server_error"
    code = "payment_provider_error"
    default_message = "The payment provider could not process the request. Try again later."
