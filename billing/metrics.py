"""Billing's part of ``GET /metrics`` (``settings.METRICS_COLLECTORS``): money at risk, for alerts.

- ``inference_billing_pending_events``: usage events not recorded yet (waiting on the billing
  queue, or held by a billing worker). It grows while billing is down or behind; no sample while
  Redis is unreachable (unknown, not 0).
- ``inference_billing_refused_events``: usage events billing refused and kept, not replayed yet
  (``manage.py replay_usage_events``); anything above 0 wants an operator.
"""

from __future__ import annotations

import logging

from django.conf import settings
from prometheus_client.core import GaugeMetricFamily

from inference_platform.celery import app
from inference_platform.readiness import check_redis

from .recovery import pending_events
from .selectors import refused_usage_events

log = logging.getLogger(__name__)


class BillingCollector:
    def __init__(self, celery_app=app, redis_url: str | None = None):
        self.celery_app = celery_app  # whose broker holds the billing queue
        self.redis_url = redis_url or settings.REDIS_URL  # the same Redis, as a Redis client names it

    def collect(self):
        pending = GaugeMetricFamily("inference_billing_pending_events",
                                    "Usage events waiting to be recorded by billing (queued or being recorded)")
        # A quick ping first: kombu retries a refused connection for seconds, longer than a scrape
        # should wait during an incident.
        reachable = check_redis(self.redis_url)  # (a unix socket's broker URL is kombu's own spelling)
        try:
            if reachable["ok"]:
                pending.add_metric([], pending_events(self.celery_app))
        except Exception as exc:  # Redis went away meanwhile: leave the sample out
            log.warning("could not count the billing queue: %s", exc)
        yield pending
        refused = GaugeMetricFamily("inference_billing_refused_events",
                                    "Usage events billing refused and kept, waiting for `manage.py replay_usage_events`")
        refused.add_metric([], len(refused_usage_events()))
        yield refused
