"""Kombu's Redis transport, keeping its blocking client instead of building one per command.

Kombu builds a new redis-py client object for every publish (and every other blocking command
it sends). Building one copies redis-py's table of response callbacks: a third of a publish's CPU,
paid by the gateway for every request and by the workers for every usage event. A client over the
channel's connection pool is thread-safe and can be kept; it is rebuilt when the pool is (after
a disconnect).
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _kept_client = None

    def _create_client(self, asynchronous=False):
        if asynchronous:  # the worker's consuming side: one client per channel already
            return super()._create_client(asynchronous=True)
        client = self._kept_client
        if client is None or client.connection_pool is not self.pool:
            client = self._kept_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


def use_for_redis_urls() -> None:
    """Make ``redis://``, ``rediss://`` and ``redis+socket://`` broker URLs use this transport (in
    this process). Kombu picks TLS by the URL's scheme, before the class: ``rediss`` keeps it."""
    for scheme in ("redis", "rediss"):
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
