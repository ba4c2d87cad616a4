"""The link that confirms a user's email address: ``uid`` and ``token`` for its URL, and the user
they name once checked. The token is Django's password-reset kind (signed, expiring after
PASSWORD_RESET_TIMEOUT), bound to the user's address and to its not being confirmed yet: it
confirms that address once, and no other."""

from __future__ import annotations

from django.contrib.auth.tokens import PasswordResetTokenGenerator
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_decode, urlsafe_base64_encode

from .models import User


class _Tokens(PasswordResetTokenGenerator):
    key_salt = "accounts.email_verification"

    def _make_hash_value(self, user, timestamp):
        return f"{user.pk}|{user.email}|{user.email_verified_at}|{timestamp}"


_tokens = _Tokens()


def link_parts(user: User) -> tuple[str, str]:
    """The (uid, token) of ``user``'s confirmation link."""
    return urlsafe_base64_encode(force_bytes(user.pk)), _tokens.make_token(user)


def user_for(uid: str, token: str) -> User | None:
    """The user a link names, if its token is theirs and still good (None otherwise)."""
    try:
        user = User.objects.get(pk=int(urlsafe_base64_decode(uid).decode()))
    except (ValueError, TypeError, OverflowError, User.DoesNotExist):
        return None
    return user if _tokens.check_token(user, token) else None
