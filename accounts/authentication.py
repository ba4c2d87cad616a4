"""API key authentication for DRF: ``Authorization: Bearer sk-...``.

``request.auth`` is the ApiKey (its ``organization`` is the caller's organization) and
``request.user`` the key's creator, or an :class:`ApiKeyUser` for a key without one. A wrong,
expired or revoked key, or one whose creator is deactivated, is a 401 with code ``invalid_api_key``.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from .errors import ApiKeyError
from .models import ApiKey
from .selectors import authenticate_api_key, parse_bearer
from .services import touch_api_key


class ApiKeyUser(AnonymousUser):
    """The principal of a key without a creator: authenticated, with no permissions of its own."""

    def __init__(self, api_key: ApiKey):
        self.api_key = api_key
        self.organization = api_key.organization

    @property
    def is_anonymous(self):
        return False

    @property
    def is_authenticated(self):
        return True

    def __str__(self):
        return f"api-key {self.api_key.display_prefix}"

    def __eq__(self, other):
        return isinstance(other, ApiKeyUser) and other.api_key.pk == self.api_key.pk

    def __hash__(self):
        return hash(("api-key", self.api_key.pk))


def user_for_api_key(api_key: ApiKey):
    creator = api_key.created_by
    if creator is not None and creator.is_active:
        return creator
    return ApiKeyUser(api_key)


def key_actor(api_key: ApiKey):
    """Whose role decides what ``api_key`` may change (an organization's spend limit, its
    deployments): its creator; None (the organization itself, no role check) only for a key the
    operator's command line made for no user. Any other key without a creator gets an
    :class:`ApiKeyUser`, which holds no role anywhere."""
    if api_key.acts_as_organization:
        return None
    return user_for_api_key(api_key)


class ApiKeyAuthentication(BaseAuthentication):
    """No Authorization header: not this scheme (other authenticators, e.g. the session, may run)."""

    def authenticate(self, request):
        header = get_authorization_header(request)
        if not header:
            return None
        try:
            api_key = authenticate_api_key(parse_bearer(header))
        except ApiKeyError as exc:
            raise AuthenticationFailed(detail=exc.message, code=exc.code) from None
        touch_api_key(api_key=api_key)
        return user_for_api_key(api_key), api_key

    def authenticate_header(self, request):
        # Makes DRF answer 401 (not 403) when credentials are missing or wrong.
        return 'Bearer realm="api"'
