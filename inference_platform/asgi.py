"""ASGI entry point: Django for HTTP, Channels for the WebSocket API."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import WebsocketDenier  # noqa: E402
from django.conf import settings  # noqa: E402
from django.http.request import split_domain_port, validate_host  # noqa: E402

from accounts.middleware import ApiKeyAuthMiddlewareStack  # noqa: E402
from inference_platform import api_handler  # noqa: E402
from inference_platform.processes import die_with_server_parent  # noqa: E402
from gateway import admission  # noqa: E402
from gateway.routing import websocket_urlpatterns  # noqa: E402

# A server process: the gateway's per-request database work runs on threads that keep their
# connections, instead of opening one per request (see gateway.admission).
admission.use_threads()
die_with_server_parent()


class SameOriginWebSockets:
    """Browsers always send Origin on a WebSocket handshake, and carry the dashboard's session
    cookie along, to any port of the host (cookies ignore ports). So a page may open the socket
    only from the origin it is served on: the Origin must name the host and port the handshake
    was sent to (its Host header; an allowed host), or be listed in CSRF_TRUSTED_ORIGINS (the
    dashboard behind a proxy under another name). API clients send no Origin and pass with their key."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not _same_origin(dict(scope.get("headers", []))):
            return await WebsocketDenier()(scope, receive, send)
        return await self.app(scope, receive, send)


def _same_origin(headers: dict[bytes, bytes]) -> bool:
    origin = headers.get(b"origin")
    if origin is None:
        return True
    origin = origin.decode("latin-1").rstrip("/")
    if origin in settings.CSRF_TRUSTED_ORIGINS:
        return True
    scheme, _, netloc = origin.partition("://")
    host = headers.get(b"host", b"").decode("latin-1")
    return (scheme in ("http", "https") and bool(host) and netloc.lower() == host.lower()
            and validate_host(split_domain_port(host)[0], settings.ALLOWED_HOSTS))


api_app = api_handler.ApiHandler()


async def http_app(scope, receive, send):
    """The inference endpoints without the site's middleware (see ``api_handler``), the rest with it."""
    app = api_app if api_handler.serves(scope["path"]) else django_asgi_app
    return await app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": SameOriginWebSockets(ApiKeyAuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
