"""What the gateway may use of the workers: enqueue a request, cancel one, describe a deployment.

The gateway never imports the engine or the tasks: it names the task, and the request travels on
the deployment's own Celery queue to whichever worker serves it.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from inference_platform.celery import app, deployment_queue

from .cancellation import CHANNEL, MARK_TTL_S, mark_key

RUN_INFERENCE = "workers.run_inference"


def engine_spec(deployment) -> dict:
    """The settings a worker needs to host a deployment's engine (JSON-safe)."""
    from models_catalog.weights import resolve_weights_path

    return {
        "id": deployment.pk,
        "name": deployment.name,
        "model": deployment.model.slug,
        "weights": str(resolve_weights_path(deployment.model)),
        "dtype": deployment.dtype,
        "batch_window_ms": deployment.batch_window_ms,
        "max_batch_size": deployment.max_batch_size,
    }


def enqueue(payload: dict) -> None:
    """Put a request on its deployment's queue (publishing to Redis; no result backend)."""
    app.send_task(
        RUN_INFERENCE, args=[payload], queue=deployment_queue(payload["deployment"]["name"]),
        task_id=payload["request_id"], ignore_result=True,
    )


async def cancel(client: aioredis.Redis, request_id: str) -> None:
    """Abort a request wherever it is: queued (the mark) or running (the broadcast)."""
    await client.set(mark_key(request_id), "1", ex=MARK_TTL_S)
    await client.publish(CHANNEL, request_id)
