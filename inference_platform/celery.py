"""The Celery app: a `billing` queue for usage events, a `batches` queue for the Batch API's
runners, a `default` queue, and one queue per deployment (`deployment.<name>`) that the GPU
workers serving it consume."""

from __future__ import annotations

import logging
import os
import threading

from celery import Celery
from celery.signals import task_postrun, task_prerun
from kombu import Queue

from .broker import use_for_redis_urls

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

use_for_redis_urls()  # before any broker connection exists
app = Celery("inference_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = (Queue("default"), Queue("billing"), Queue("batches"))
app.conf.task_routes = {"billing.tasks.*": {"queue": "billing"}, "gateway.run_batch": {"queue": "batches"}}
app.autodiscover_tasks()


# Threads of a worker process that keep their database connection between tasks: a few, because
# an idle pool thread never gives its connection back and a worker may have 64 threads.
KEPT_CONNECTIONS = 4
_keepers: set[int] = set()
_keepers_lock = threading.Lock()


@task_prerun.connect
@task_postrun.connect
def _recycle_connections(task=None, **_) -> None:
    """Around each task, as Django does around each request: close this thread's database
    connections that are broken or older than CONN_MAX_AGE, and keep the rest on up to
    ``KEPT_CONNECTIONS`` threads (opening one costs more than a usage event's queries). Not for a
    task run in place (``apply``): it is inside its caller's transaction."""
    from django.db import close_old_connections, connections

    if task is not None and getattr(task.request, "is_eager", False):
        return
    close_old_connections()
    if not any(conn.connection is not None for conn in connections.all(initialized_only=True)):
        return
    with _keepers_lock:
        me = threading.get_ident()
        if me in _keepers or len(_keepers) < KEPT_CONNECTIONS:
            _keepers.add(me)
            return
    connections.close_all()


class QuietRoutineTasks(logging.Filter):
    """Leaves out the "received" and "succeeded" lines of the placement loop's tick, which runs
    every couple of seconds on every worker of the default queue (tens of thousands of lines a
    day each); its warnings and failures still show, as every other task's lines do."""

    ROUTINE = ("workers.fleet_tick[",)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        message = record.getMessage()
        return not any(name in message for name in self.ROUTINE)


for _name in ("celery.app.trace", "celery.worker.strategy"):  # where Celery writes those lines
    logging.getLogger(_name).addFilter(QuietRoutineTasks())


DEPLOYMENT_QUEUE_PREFIX = "deployment."


def deployment_queue(deployment_name: str) -> str:
    """The Celery queue a deployment's requests travel on."""
    return f"{DEPLOYMENT_QUEUE_PREFIX}{deployment_name}"
