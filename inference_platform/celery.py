"""The Celery app: a `billing` queue for usage events, a `default` queue, and one queue per
deployment (`deployment.<name>`) that the GPU workers serving it consume."""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

app = Celery("inference_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = (Queue("default"), Queue("billing"))
app.conf.task_routes = {"billing.tasks.*": {"queue": "billing"}}
app.autodiscover_tasks()


def deployment_queue(deployment_name: str) -> str:
    """The Celery queue a deployment's requests travel on."""
    return f"deployment.{deployment_name}"
