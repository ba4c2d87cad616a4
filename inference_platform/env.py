"""Settings from environment variables: small parsers with clear errors, no third-party helpers."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from django.core.exceptions import ImproperlyConfigured

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


SECRET_KEY_MIN_LENGTH = 32
SECRET_KEY_HOW = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(50))'"


def secret_key_problem(value: str, placeholder: str) -> str | None:
    """What is wrong with ``value`` as a production SECRET_KEY, as a whole sentence; None if fine.

    Each refusal says which rule it broke and how to make a good key.
    """
    mode = "production mode (DEBUG=false) needs a long random SECRET_KEY"
    if not value.strip():
        problem = "SECRET_KEY is not set"
    elif value == placeholder or "change-me" in value:
        problem = "SECRET_KEY is the example's placeholder (it contains \"change-me\")"
    elif len(value) < SECRET_KEY_MIN_LENGTH:
        problem = f"SECRET_KEY is too short: {len(value)} characters, needs {SECRET_KEY_MIN_LENGTH} or more"
    else:
        return None
    return f"{problem}: {mode}; {SECRET_KEY_HOW}"


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, not {raw!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, not {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {raw!r}")
    return value


def env_seconds(name: str, default: str, *, minimum: float) -> float:
    raw = os.environ.get(name, default).strip() or default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number of seconds, not {raw!r}") from None
    if not minimum <= value < float("inf"):  # nan and inf included
        raise ImproperlyConfigured(f"{name} must be a finite number of at least {minimum:g} seconds, not {raw!r}")
    return value


def env_url(name: str) -> str:
    """An http(s) address without its trailing slash ("" when unset)."""
    raw = os.environ.get(name, "").strip()
    parts = urlsplit(raw)
    if raw and (parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment):
        raise ImproperlyConfigured(f"{name} must be an http:// or https:// address such as https://llm.example.com, "
                                   f"not {raw!r}")
    return raw.rstrip("/")


def env_redis_url(name: str) -> str:
    """A Redis address, redis://, rediss:// or unix:// ("" when unset)."""
    raw = os.environ.get(name, "").strip()
    try:
        scheme = urlsplit(raw).scheme
    except ValueError:  # e.g. an unclosed "[" of an IPv6 address
        scheme = None
    if raw and scheme not in ("redis", "rediss", "unix"):
        shown = repr(redact_url(raw)) if scheme is not None else "an address that cannot be read"
        raise ImproperlyConfigured(f"{name} must start with redis://, rediss:// or unix://, such as "
                                   f"redis://127.0.0.1:6379/0, not {shown}")
    return raw


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def redact_url(url: str) -> str:
    """The URL with its password replaced, safe to print in an error message."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def database_from_url(url: str, *, data_dir: Path) -> dict:
    """A Django DATABASES entry from ``postgresql://`` or ``sqlite:///`` URLs (empty: a SQLite file)."""
    if not url:
        return _sqlite(data_dir / "db.sqlite3")
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        # sqlite:///relative.db and sqlite:////absolute.db, as SQLAlchemy reads them: the path
        # after the third slash (sqlite:///db.sqlite3 was /db.sqlite3, at the root).
        return _sqlite(unquote(parts.path)[1:] or "db.sqlite3")
    if parts.scheme in {"postgres", "postgresql", "pgsql"}:
        try:
            port = parts.port
        except ValueError:
            raise ImproperlyConfigured(f"DATABASE_URL has a bad port: {redact_url(url)!r}") from None
        # The query string is libpq's connection parameters (sslmode=verify-full, sslrootcert=...):
        # dropped, a connection asked to verify TLS would not. A host that drops packets fails in
        # seconds, not the system's two-minute TCP timeout.
        options = {"connect_timeout": 5, **dict(parse_qsl(parts.query, keep_blank_values=True))}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")) or "postgres",
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ImproperlyConfigured(
        f"DATABASE_URL must start with postgresql:// or sqlite:///, not {redact_url(url)!r}"
    )


def _sqlite(name) -> dict:
    """SQLite for several processes writing at once (web, workers, billing): transactions take the
    write lock when they begin, so a busy database is waited for (up to 20 s) instead of failing a
    read-then-write transaction with "database is locked"; WAL lets readers go on meanwhile. Each
    thread keeps its connection for a minute, as with PostgreSQL: opening one (and its pragma) was
    a quarter of billing's CPU per usage event."""
    return {"ENGINE": "django.db.backends.sqlite3", "NAME": name, "CONN_MAX_AGE": 60, "CONN_HEALTH_CHECKS": True,
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20, "init_command": "PRAGMA journal_mode=WAL;"}}


def celery_broker_url(redis_url: str) -> str:
    """Kombu spells a unix-socket Redis URL differently from redis-py."""
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url[len("unix://"):]
    return redis_url
