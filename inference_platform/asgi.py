"""ASGI entry point: Django for HTTP, Channels for the WebSocket API."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import OriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.http.request import validate_host  # noqa: E402

from accounts.middleware import ApiKeyAuthMiddlewareStack  # noqa: E402
from inference_platform import api_handler  # noqa: E402
from gateway import admission  # noqa: E402
from gateway.routing import websocket_urlpatterns  # noqa: E402

# A server process: the gateway's per-request database work runs on threads that keep their
# connections, instead of opening one per request (see gateway.admission).
admission.use_threads()


class BrowserOriginValidator(OriginValidator):
    """Browsers always send Origin on a WebSocket handshake, so a cross-site page riding on the
    dashboard's session cookie is refused; API clients (no Origin, a Bearer key) pass."""

    def valid_origin(self, parsed_origin):
        if parsed_origin is None:
            return True
        return bool(parsed_origin.hostname) and validate_host(parsed_origin.hostname, settings.ALLOWED_HOSTS)


api_app = api_handler.ApiHandler()


async def http_app(scope, receive, send):
    """The inference endpoints without the site's middleware (see ``api_handler``), the rest with it."""
    app = api_app if api_handler.serves(scope["path"]) else django_asgi_app
    return await app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": BrowserOriginValidator(ApiKeyAuthMiddlewareStack(URLRouter(websocket_urlpatterns)), []),
    }
)
