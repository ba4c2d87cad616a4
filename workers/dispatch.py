"""What the gateway may use of the workers: enqueue a request, cancel one, describe a deployment.

The gateway never imports the engine or the tasks: it names the task, and the request travels on
the deployment's own Celery queue to whichever worker serves it.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from django.conf import settings

from inference_platform.celery import app, deployment_queue

from .cancellation import CHANNEL, MARK_TTL_S, mark_key, mark_value

RUN_INFERENCE = "workers.run_inference"


# The deployment's columns a spec is made of: ``Deployment.objects.values(*SPEC_FIELDS)`` reads
# them without building model instances (the gateway does this for every request).
SPEC_FIELDS = ("id", "name", "status", "dtype", "quantization", "batch_window_ms", "max_batch_size",
               "model__slug", "model__weights_path")


def engine_spec(deployment) -> dict:
    """The settings a worker needs to host a deployment's engine (JSON-safe)."""
    return spec_from_row({
        "id": deployment.pk, "name": deployment.name, "dtype": deployment.dtype,
        "quantization": deployment.quantization, "batch_window_ms": deployment.batch_window_ms,
        "max_batch_size": deployment.max_batch_size, "model__slug": deployment.model.slug,
        "model__weights_path": deployment.model.weights_path,
    })


def spec_from_row(row: dict) -> dict:
    """:func:`engine_spec` from a ``values(*SPEC_FIELDS)`` row."""
    from models_catalog.models import CatalogModel
    from models_catalog.weights import resolve_weights_path

    weights = resolve_weights_path(CatalogModel(slug=row["model__slug"], weights_path=row["model__weights_path"]))
    return {
        "id": row["id"],
        "name": row["name"],
        "model": row["model__slug"],
        "weights": str(weights),
        "dtype": row["dtype"],
        "quantization": row["quantization"],
        "batch_window_ms": row["batch_window_ms"],
        "max_batch_size": row["max_batch_size"],
    }


def queue_lists(name: str) -> list[str]:
    """The Redis lists the deployment's waiting requests are on: the sum of their lengths is how
    many wait, for a check made inside a Redis script."""
    from .fleet import queue_lists as lists

    return lists(deployment_queue(name))


def response_format_problem(response_format: dict) -> str | None:
    """Why the engine cannot follow this response_format (None when it can). The grammar module
    is plain Python (no torch): the gateway refuses a schema at once, as the worker would."""
    from workers.engine.json_grammar import SchemaError, grammar_for

    try:
        grammar_for(response_format)
    except SchemaError as exc:
        return str(exc)
    return None


def tools_problem(tools: list[dict], tool_choice, parallel: bool) -> str | None:
    """Why the engine cannot make the model call these tools as asked (None when it can)."""
    from workers.engine.json_grammar import SchemaError
    from workers.engine.tool_calls import tool_grammar_for

    try:
        tool_grammar_for(tools, tool_choice, parallel)
    except SchemaError as exc:
        return str(exc)
    return None


def tool_call_parser(*, text: bool):
    """A reader of a reply's tool calls, in the form the engine makes the model write them
    (``workers.engine.tool_calls.ToolCallParser``; plain Python)."""
    from workers.engine.tool_calls import ToolCallParser

    return ToolCallParser(text=text)


def serving_key(name: str) -> str:
    """Set by the heartbeat of each live worker hosting the deployment's engine (expiring with
    its liveness): while it exists, the deployment's waiting requests wait for a busy replica,
    not for none."""
    return f"fleet:serving:{name}"


def waiting_key(name: str) -> str:
    """The requests admitted to the deployment that have not had their first token yet (a sorted
    set of request ids by admission time, ``gateway.ratelimit``): what its queue limit counts,
    wherever they wait (its queue, a worker that took more than its engine runs, a model's load)."""
    return f"queue:waiting:{name}"


# A gateway process's pulse (``gateway.pulse``): the workers running its requests check it
# (``workers.pulse``), and cancel them once it has been gone a while: a gateway that died took its
# clients' connections along, and its requests would run to their end for nobody, billed whole.
PULSE_EVERY_S = 3.0
PULSE_TTL_S = 9


def pulse_key(reply_channel: str) -> str:
    """The pulse of the gateway process a reply channel belongs to (its name up to the "!" is
    the process's, ``channels_redis``'s ``new_channel``)."""
    return f"gateway:pulse:{reply_channel.split('!', 1)[0]}"


def longest_wait() -> float:
    """Seconds a gateway may wait for a request's first token: for a worker (a cold start's
    wait, then busy replicas), for the model's load, then for the token. A waiting request
    admitted longer ago is one whose gateway died without letting it go: it waits no more."""
    return (max(settings.GATEWAY_QUEUE_TIMEOUT, settings.FLEET_COLD_START_TIMEOUT) + settings.GATEWAY_START_TIMEOUT
            + 2 * settings.GATEWAY_STALL_TIMEOUT)


async def served(client: aioredis.Redis, name: str) -> bool:
    return bool(await client.exists(serving_key(name)))


def enqueue(payload: dict) -> None:
    """Put a request on its deployment's queue (publishing to Redis; no result backend). The
    message's printable form names the request only: Celery would otherwise render the whole
    payload, prompt included, into every log line and monitor (and spend a third of the publish
    doing it)."""
    app.send_task(
        RUN_INFERENCE, args=[payload], queue=deployment_queue(payload["deployment"]["name"]),
        task_id=payload["request_id"], ignore_result=True,
        argsrepr=f"[{payload['request_id']!r}]", kwargsrepr="{}",
    )


async def cancel(client: aioredis.Redis, request_id: str, *, void: bool = False) -> None:
    """Abort a request wherever it is: queued (the mark) or running (the broadcast). ``void``: the
    gateway gave up on it, not its client (see ``workers.cancellation``)."""
    await client.set(mark_key(request_id), mark_value(void=void), ex=MARK_TTL_S)
    await client.publish(CHANNEL, request_id)
