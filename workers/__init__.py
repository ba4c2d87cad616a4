"""The GPU worker runtime: Celery tasks that host the inference engine (in ``workers.engine``)."""
