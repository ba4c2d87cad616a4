"""WebSocket routes of the public API (the consumer arrives with the inference API)."""

websocket_urlpatterns: list = []
