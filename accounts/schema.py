"""How the OpenAPI document describes API-key authentication (drf-spectacular finds this extension
when the module is imported, which ``AccountsConfig.ready`` does)."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.ApiKeyAuthentication"
    name = "bearer"  # the same scheme the inference endpoints name

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An API key: `Authorization: Bearer sk-...`."}
