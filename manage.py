#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys


def _stop_if_down(check) -> None:
    """After a connection error: when ``check`` (the operator CLI's own check of the database or
    Redis) finds the service down, stop with its one line instead of a traceback; otherwise the
    error was something else and is raised as it is."""
    from django.conf import settings
    from django.db import connection

    from inference_platform.cli import Abort

    connection.close()  # ask on a fresh connection: the failed one may be broken or carry its session's settings
    try:
        check(settings)
    except Abort as exc:
        sys.exit(f"error: {exc}")


def main():
    os.umask(0o077)  # as `inference-platform` does: the SQLite database and logs are this user's only
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db.utils import InterfaceError, OperationalError
    from kombu.exceptions import OperationalError as BrokerError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        sys.exit(f"error: {exc}")
    except (OperationalError, InterfaceError):
        from inference_platform.cli import require_database

        _stop_if_down(require_database)
        raise
    except (RedisConnectionError, RedisTimeoutError, BrokerError):
        from inference_platform.cli import require_redis

        _stop_if_down(require_redis)
        raise


if __name__ == "__main__":
    main()
