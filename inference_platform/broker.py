"""Kombu's Redis transport, keeping its blocking client instead of building one per command.

Kombu builds a new redis-py client object for every publish (and every other blocking command
it sends). Building one copies redis-py's table of response callbacks: a third of a publish's CPU,
paid by the gateway for every request and by the workers for every usage event. A client over the
channel's connection pool is thread-safe and can be kept; it is rebuilt when the pool is (after
a disconnect).
"""

from __future__ import annotations

import logging

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger(__name__)


def _closed(channel) -> bool:
    """Whether the channel's connection was closed under it (Redis went away): kombu leaves it no
    transport, or a transport without its client, and then fails with an AttributeError."""
    return channel.connection is None or channel.connection.client is None


class QoS(kombu_redis.QoS):
    def restore_unacked(self, client=None):
        """Kombu restores a channel's unacknowledged messages as it closes it; on a connection
        already closed that failed and stopped the worker for good. The messages are still in
        Redis's unacknowledged set, as long as Redis kept them, where the fleet's recovery or the
        visibility timeout redelivers them: leave them there."""
        if client is None and _closed(self.channel):
            log.warning("not restoring %d unacknowledged messages: the broker connection is closed",
                        len(self._delivered))
            self._delivered.clear()
            return None
        return super().restore_unacked(client)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _kept_client = None

    def _create_client(self, asynchronous=False):
        if _closed(self):  # a connection error, which Celery and kombu's retries handle: not a crash
            raise RedisConnectionError("the broker connection is closed")
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
