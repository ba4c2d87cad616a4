"""The Celery app: a `billing` queue for usage events, a `default` queue, and one queue per
deployment (`deployment.<name>`) that the GPU workers serving it consume."""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import task_postrun, task_prerun
from kombu import Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

app = Celery("inference_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = (Queue("default"), Queue("billing"))
app.conf.task_routes = {"billing.tasks.*": {"queue": "billing"}}
app.autodiscover_tasks()


@task_prerun.connect
@task_postrun.connect
def _recycle_connections(task=None, **_) -> None:
    """Around each task, as Django does around each request: close this thread's database
    connections that are broken or older than CONN_MAX_AGE, and keep the rest (opening one costs
    more than a usage event's queries). Not for a task run in place (``apply``): it is inside its
    caller's transaction."""
    from django.db import close_old_connections

    if task is None or not getattr(task.request, "is_eager", False):
        close_old_connections()


def deployment_queue(deployment_name: str) -> str:
    """The Celery queue a deployment's requests travel on."""
    return f"deployment.{deployment_name}"
