"""A worker takes from the broker what its engines can run, not its whole thread count.

The consumer here is the part of Celery's that the reservations read and set: its kombu ``QoS``
(the real one, which the consumer loop applies) and the queues its task consumer consumes. The
fleet test (``test_fleet.py``) checks the same against real workers and a real burst.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from kombu import Queue
from kombu.common import QoS

from workers.reservations import Reservations, reserve_for


def _consumer(*queues: str, threads: int = 64) -> SimpleNamespace:
    applied: list[int] = []
    qos = QoS(lambda prefetch_count: applied.append(prefetch_count), threads)
    qos.update()
    return SimpleNamespace(qos=qos, initial_prefetch_count=threads, applied=applied,
                           task_consumer=SimpleNamespace(queues=[Queue(name) for name in queues]))


@pytest.mark.parametrize(("batch", "reserved"), [(1, 2), (2, 3), (4, 5), (5, 7), (32, 40), (256, 320)])
def test_a_deployment_reserves_its_batch_and_a_quarter_more(batch, reserved):
    assert reserve_for(batch) == reserved


def test_the_prefetch_follows_the_deployments_hosted_and_the_other_queues():
    consumer = _consumer("default", "billing", "deployment.a", "deployment.b")
    reservations = Reservations()
    reservations.attach(consumer)
    assert consumer.qos.value == 64  # nothing hosted yet: Celery's own

    reservations.serve("a", 2)
    reservations.serve("b", 32)
    assert consumer.qos.value == 3 + 40 + 2
    consumer.qos.update()  # what the consumer loop does between two turns
    assert consumer.applied[-1] == 45
    assert consumer.initial_prefetch_count == 45  # a reconnection starts from it

    reservations.serve("b", 4)  # its settings changed
    assert consumer.qos.value == 3 + 5 + 2
    reservations.forget("a")
    assert consumer.qos.value == 5 + 2
    reservations.forget("b")
    assert consumer.qos.value == 64


def test_a_billing_worker_keeps_celerys_prefetch():
    consumer = _consumer("default", "billing", threads=4)
    reservations = Reservations()
    reservations.attach(consumer)
    reservations.apply()
    assert consumer.qos.value == 4 and consumer.applied == [4]


def test_never_more_than_the_threads_and_the_operator_is_told(caplog):
    consumer = _consumer("deployment.big", threads=16)
    reservations = Reservations()
    reservations.attach(consumer)
    with caplog.at_level(logging.WARNING, logger="workers.reservations"):
        reservations.serve("big", 64)
        reservations.apply()
    assert consumer.qos.value == 16
    [warning] = [r.getMessage() for r in caplog.records]
    assert "big=64" in warning and "--concurrency 80" in warning


def test_a_reconnection_resets_celerys_prefetch_and_the_next_apply_sets_it_again():
    consumer = _consumer("deployment.a")
    reservations = Reservations()
    reservations.attach(consumer)
    reservations.serve("a", 8)
    assert consumer.qos.value == 10
    consumer.qos = QoS(lambda prefetch_count: None, 64)  # Celery builds a new one on a reconnection
    reservations.apply()
    assert consumer.qos.value == 10


def test_an_unreadable_batch_size_changes_nothing():
    consumer = _consumer("deployment.a")
    reservations = Reservations()
    reservations.attach(consumer)
    reservations.serve("a", None)
    assert consumer.qos.value == 64


def test_a_request_of_several_answers_counts_for_each_while_it_runs():
    from workers.choices import sequences

    consumer = _consumer("deployment.a", "deployment.b")
    reservations = Reservations()
    reservations.attach(consumer)
    reservations.serve("a", 8)
    reservations.serve("b", 2)
    assert consumer.qos.value == 10 + 3
    four = sequences({"n": 2, "prompts": ["x", "y"]})
    assert four == 4 and sequences({"n": 3, "messages": []}) == 3 and sequences({"prompt": "x"}) == 1
    with reservations.holding("a", four):
        assert consumer.qos.value == 7 + 3  # its message is one of a's ten; its other answers take three more
        with reservations.holding("a", 128):
            assert consumer.qos.value == 3  # a's share is spent, b's stays
        assert consumer.qos.value == 10
    assert consumer.qos.value == 13
    with pytest.raises(RuntimeError), reservations.holding("b", 3):
        raise RuntimeError("the request failed")
    assert consumer.qos.value == 13  # given back however the request ends
    reservations.forget("b")
    with reservations.holding("a", 64):
        assert consumer.qos.value == 1  # never 0, which is "no limit"


def test_held_answers_are_counted_under_the_thread_ceiling_too():
    consumer = _consumer("deployment.big", threads=16)
    reservations = Reservations()
    reservations.attach(consumer)
    reservations.serve("big", 64)  # a share of 80, over the 16 threads
    assert consumer.qos.value == 16
    with reservations.holding("big", 70):
        assert consumer.qos.value == 80 - 69


@pytest.mark.parametrize("slots", [1, 4, 8])
def test_a_worker_started_without_concurrency_fills_the_batches_of_its_slots_without_warning(slots, caplog):
    """``up`` and ``worker`` size the thread pool for their slots: a second deployment placed on a
    worker of 64 threads warned that its batches could not fill."""
    from inference_platform.cli import default_concurrency
    from models_catalog.models import Deployment

    threads = default_concurrency(slots=slots, other_queues=1)
    assert threads >= 64
    consumer = _consumer("default", *(f"deployment.d{i}" for i in range(slots)), threads=threads)
    reservations = Reservations()
    reservations.attach(consumer)
    with caplog.at_level(logging.WARNING, logger="workers.reservations"):
        for i in range(slots):
            reservations.serve(f"d{i}", Deployment().max_batch_size)
    assert consumer.qos.value == slots * reserve_for(Deployment().max_batch_size) + 1
    assert not caplog.records, caplog.text
