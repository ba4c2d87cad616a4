"""Worker logs: the placement loop's tick, every couple of seconds on every worker of the
default queue, does not fill them; every other task's lines, and the tick's failures, stay."""

from __future__ import annotations

import logging

import inference_platform.celery  # noqa: F401  (attaches the filter)

SUCCEEDED = "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s"


def _succeeded(name: str) -> dict:
    return {"name": name, "id": "9bced884", "runtime": 0.02, "return_value": None}


def test_the_ticks_routine_lines_are_left_out_and_the_rest_kept(caplog):
    trace, strategy = logging.getLogger("celery.app.trace"), logging.getLogger("celery.worker.strategy")
    with caplog.at_level(logging.INFO):
        trace.info(SUCCEEDED, _succeeded("workers.fleet_tick"))
        strategy.info("Task %s[%s] received", "workers.fleet_tick", "9bced884")
        trace.info(SUCCEEDED, _succeeded("workers.run_inference"))
        trace.error("Task %(name)s[%(id)s] raised unexpected: %(exc)s",
                    {"name": "workers.fleet_tick", "id": "1", "exc": "OperationalError"})
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["Task workers.run_inference[9bced884] succeeded in 0.02s: None",
                     "Task workers.fleet_tick[1] raised unexpected: OperationalError"]
