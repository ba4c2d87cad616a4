"""WebSocket routes of the public API."""

from django.urls import path

from .consumers import InferenceConsumer

websocket_urlpatterns = [path("v1/ws", InferenceConsumer.as_asgi())]
