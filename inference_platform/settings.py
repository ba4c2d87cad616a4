"""Django settings: every value comes from an environment variable with a working default.

The defaults are the embedded development setup (SQLite under ``DATA_DIR``, a private Redis on a
unix socket under ``DATA_DIR``). Production (``DEBUG=false``) refuses to start without a real
``SECRET_KEY`` and ``ALLOWED_HOSTS``.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from .env import (celery_broker_url, database_from_url, env_bool, env_int, env_list, env_redis_url, env_seconds,
                  env_str, env_url, secret_key_problem)

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("DATA_DIR", str(BASE_DIR / ".data"))).resolve()

DEFAULT_SECRET_KEY = "dev-insecure-secret-key-change-me"
DEBUG = env_bool("DEBUG", True)
SECRET_KEY = env_str("SECRET_KEY", DEFAULT_SECRET_KEY)
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]"]
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ",".join(LOOPBACK_HOSTS) if DEBUG else "")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")
# HTTPS=true: the site is served over HTTPS (usually by a proxy in front that sets
# X-Forwarded-Proto): cookies go out with the Secure flag, browsers are told to stay on HTTPS, and
# the proxy's header says whether a request came over HTTPS. Off by default, as the embedded
# defaults serve plain HTTP on localhost (Secure cookies would make logging in impossible there).
HTTPS = env_bool("HTTPS", False)
if HTTPS:
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 3600, minimum=0)

if not DEBUG:
    # Unset reads as unset, not as the development default it falls back to.
    if (problem := secret_key_problem(env_str("SECRET_KEY"), DEFAULT_SECRET_KEY)) is not None:
        raise ImproperlyConfigured(problem)
    if not ALLOWED_HOSTS:
        raise ImproperlyConfigured(
            "ALLOWED_HOSTS is empty: production mode (DEBUG=false) needs the host names it serves, "
            "comma-separated"
        )
# The loopback names too, always: `up` and compose's health check call /readyz on 127.0.0.1, and a
# request naming this machine by loopback comes from this machine.
ALLOWED_HOSTS += [host for host in LOOPBACK_HOSTS if host not in ALLOWED_HOSTS]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "accounts",
    "models_catalog",
    "gateway",
    "workers",
    "billing",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "inference_platform.request_id.RequestIdMiddleware",
    "inference_platform.api_errors.ApiErrorsMiddleware",
    "dashboard.not_found.NotFoundPageMiddleware",
]

ROOT_URLCONF = "inference_platform.urls"
ASGI_APPLICATION = "inference_platform.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "dashboard.context_processors.dashboard",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(env_str("DATABASE_URL"), data_dir=DATA_DIR)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_USER_MODEL = "accounts.User"

# One Redis for the Celery broker, the Channels layer and the cache. Unset: the private Redis that
# `inference-platform up` starts on a unix socket under DATA_DIR.
EMBEDDED_REDIS_SOCKET = DATA_DIR / "redis.sock"
REDIS_URL = env_redis_url("REDIS_URL") or f"unix://{EMBEDDED_REDIS_SOCKET}"
REDIS_IS_EMBEDDED = not env_redis_url("REDIS_URL")

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "ip",
    }
}
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "inference_platform.channel_layer.RedisChannelLayer",
        # The socket timeout must outlast channels_redis's 5 s blocking pops (redis-py's default is 5 s).
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}], "capacity": 1000, "expiry": 120,
                   # A gateway process has ONE channel for all its streams (process-specific names):
                   # at 1,000, half a second of stall under load refused every stream.
                   "channel_capacity": {"specific.*": 100_000}},
    }
}

CELERY_BROKER_URL = celery_broker_url(REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A worker serving inference sizes its prefetch itself (workers.reservations). Celery's own
# reduction after a reconnection would restart it from the thread count and grow it back there.
CELERY_WORKER_ENABLE_PREFETCH_COUNT_REDUCTION = False
CELERY_TASK_DEFAULT_QUEUE = "default"
# Celery's Django fixup closes every database connection around every task unless this is set;
# ``inference_platform.celery`` applies Django's own rule (CONN_MAX_AGE, broken ones) instead.
CELERY_DB_REUSE_MAX = 1_000_000
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A redelivered (unacknowledged) task comes back after this long; keep it above the longest request.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600, minimum=5),
    # A Redis that froze (or vanished without closing its connections) fails a publish or an
    # inspect after this long instead of hanging it forever; consumers' BRPOPs wait 1 s at a time.
    "socket_timeout": 10, "socket_connect_timeout": 5,
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"

# Where users reach the dashboard, for links in emails (without it, those sent while answering a
# request link to the host it named, and the others, such as low-balance alerts, to OWN_SITE_URL:
# the address `up` listens on, which it sets for its processes).
SITE_URL = env_url("SITE_URL")
OWN_SITE_URL = env_url("OWN_SITE_URL")
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "noreply@localhost")
# For EMAIL_BACKEND=django.core.mail.backends.filebased.EmailBackend: the folder emails are written to.
EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH", str(DATA_DIR / "mail"))
# For EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend: where invitations and password
# resets go out.
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = 10  # a mail server that does not answer must not hold a request for minutes

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["inference_platform.jsonbody.JSONParser", "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Inference Platform API",
    "DESCRIPTION": "OpenAI-compatible inference, deployments and usage.",
    "VERSION": "1.0.0",
}

# The inference gateway.
GATEWAY_MAX_BODY_BYTES = env_int("GATEWAY_MAX_BODY_BYTES", 1 << 20, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = GATEWAY_MAX_BODY_BYTES + 1
GATEWAY_QUEUE_TIMEOUT = env_seconds("GATEWAY_QUEUE_TIMEOUT", "30", minimum=0.1)  # no worker took it: 503
GATEWAY_START_TIMEOUT = env_seconds("GATEWAY_START_TIMEOUT", "300", minimum=0.1)  # model load + admission: 504
GATEWAY_STALL_TIMEOUT = env_seconds("GATEWAY_STALL_TIMEOUT", "120", minimum=0.1)  # no token for this long: 504
RATE_LIMIT_KEY_RPM = env_int("RATE_LIMIT_KEY_RPM", 600, minimum=1)
RATE_LIMIT_ORG_RPM = env_int("RATE_LIMIT_ORG_RPM", 3000, minimum=1)
RATE_LIMIT_KEY_TPM = env_int("RATE_LIMIT_KEY_TPM", 2_000_000, minimum=1)
RATE_LIMIT_ORG_TPM = env_int("RATE_LIMIT_ORG_TPM", 10_000_000, minimum=1)
# How long a Responses API response asked to be stored is kept (0: none is stored).
RESPONSES_RETENTION_DAYS = env_int("RESPONSES_RETENTION_DAYS", 30, minimum=0)
if RESPONSES_RETENTION_DAYS > 36500:  # beyond, the date it counts back to is before year 1
    raise ImproperlyConfigured(f"RESPONSES_RETENTION_DAYS must be at most 36500, not {RESPONSES_RETENTION_DAYS}")
# The Batch API: a batch's requests are billed at this share of the model's prices.
BATCH_PRICE_FACTOR = env_str("BATCH_PRICE_FACTOR", "0.5").strip()  # a decimal string: money is never a float
try:
    if not 0 < Decimal(BATCH_PRICE_FACTOR) <= 1:
        raise ValueError
except (ArithmeticError, ValueError):
    raise ImproperlyConfigured(f"BATCH_PRICE_FACTOR must be a decimal in (0, 1], not {BATCH_PRICE_FACTOR!r}") from None
BATCH_MAX_IN_FLIGHT = env_int("BATCH_MAX_IN_FLIGHT", 16, minimum=1)  # requests of one batch running at once
# Batch requests wait while a deployment's queue holds this share of its limit: the rest is the API's.
BATCH_QUEUE_PERCENT = env_int("BATCH_QUEUE_PERCENT", 50, minimum=1)
if BATCH_QUEUE_PERCENT > 100:
    raise ImproperlyConfigured(f"BATCH_QUEUE_PERCENT must be at most 100, not {BATCH_QUEUE_PERCENT}")
FILES_MAX_BYTES = env_int("FILES_MAX_BYTES", 50 << 20, minimum=1024)  # the largest file a client may upload
BATCH_OUTPUT_RETENTION_DAYS = env_int("BATCH_OUTPUT_RETENTION_DAYS", 30, minimum=1)  # a batch's output and error files
if BATCH_OUTPUT_RETENTION_DAYS > 36500:
    raise ImproperlyConfigured(f"BATCH_OUTPUT_RETENTION_DAYS must be at most 36500, not {BATCH_OUTPUT_RETENTION_DAYS}")

# Where operators keep model weights; catalog imports may only read below it.
MODELS_ROOT = Path(env_str("MODELS_ROOT", str(DATA_DIR / "models"))).resolve()
# How long /readyz waits for a Celery worker to answer a ping.
READYZ_WORKER_TIMEOUT = env_seconds("READYZ_WORKER_TIMEOUT", "1.0", minimum=0.05)

LOG_LEVEL = env_str("LOG_LEVEL", "INFO").strip().upper() or "INFO"
if LOG_LEVEL not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
    raise ImproperlyConfigured(f"LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {LOG_LEVEL!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # Django's own console handler (in debug mode) would print each of its lines a second time,
    # without the time: its loggers go through the root's handler alone.
    "loggers": {"django": {"handlers": [], "level": "INFO", "propagate": True}},
}

# --- billing (billing/): sign-up credit, Stripe top-ups ----------------------------------------
# Money settings are Decimal USD. Without STRIPE_SECRET_KEY top-ups answer 503 (usage billing and
# the ledger work regardless). STRIPE_API_BASE unset: Stripe's own API; tests point it at localstripe.
import re  # noqa: E402


def _env_decimal(name: str, default: str) -> Decimal:
    """An amount in USD written plainly ("5", "5.00"): no sign, no exponent (the pages show it as set)."""
    raw = env_str(name, default).strip() or default
    if not re.fullmatch(r"[0-9]{1,12}(\.[0-9]{1,6})?", raw):
        raise ImproperlyConfigured(f"{name} must be a decimal amount in USD, like {default}, not {raw!r}")
    return Decimal(raw)


BILLING_SIGNUP_CREDIT = _env_decimal("BILLING_SIGNUP_CREDIT", "5.00")
# Anyone who reaches the dashboard may create an account and organization; false: only through an
# invitation (an operator makes the first accounts: manage.py createsuperuser, inference-platform createkey).
SIGNUP_OPEN = env_bool("SIGNUP_OPEN", True)
# An open sign-up's sign-up credit waits until its user confirms their email address (a link
# mailed to it): else anyone could script accounts for free credit. False: the credit comes at once.
SIGNUP_VERIFY_EMAIL = env_bool("SIGNUP_VERIFY_EMAIL", True)
STRIPE_SECRET_KEY = env_str("STRIPE_SECRET_KEY")
STRIPE_PUBLISHABLE_KEY = env_str("STRIPE_PUBLISHABLE_KEY")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET")
STRIPE_API_BASE = env_str("STRIPE_API_BASE") or None
STRIPE_JS_URL = env_str("STRIPE_JS_URL", "https://js.stripe.com/v3/")
TOPUP_MIN = _env_decimal("TOPUP_MIN", "5.00")
TOPUP_MAX = _env_decimal("TOPUP_MAX", "1000.00")
if TOPUP_MIN > TOPUP_MAX:
    raise ImproperlyConfigured(f"TOPUP_MIN ({TOPUP_MIN}) is above TOPUP_MAX ({TOPUP_MAX})")
# --- end billing ------------------------------------------------------------------------------

# --- the worker fleet (workers/): heartbeats, placement, scale to zero, metrics -----------------
# Every worker process refreshes its liveness and (a fleet worker, WORKER_SLOTS > 0) its heartbeat
# every FLEET_HEARTBEAT_SECONDS; FLEET_MISSED_HEARTBEATS missed ones mark it gone. Celery beat runs
# the placement loop (workers.fleet_tick) every FLEET_TICK_SECONDS on the default queue.
# What one organization's own deployments may hold (the operator's are not counted).
ORG_MAX_DEPLOYMENTS = env_int("ORG_MAX_DEPLOYMENTS", 50, minimum=0)
ORG_MAX_RESERVED_REPLICAS = env_int("ORG_MAX_RESERVED_REPLICAS", 16, minimum=0)  # see reserved_replicas
WORKER_SLOTS = env_int("WORKER_SLOTS", 0, minimum=0)  # deployments this worker process may host; 0: not a fleet worker
FLEET_HEARTBEAT_SECONDS = env_seconds("FLEET_HEARTBEAT_SECONDS", "5", minimum=0.2)
FLEET_MISSED_HEARTBEATS = env_int("FLEET_MISSED_HEARTBEATS", 3, minimum=2)
FLEET_TICK_SECONDS = env_seconds("FLEET_TICK_SECONDS", "2", minimum=0.2)
FLEET_SCALE_UP_QUEUE_DEPTH = env_int("FLEET_SCALE_UP_QUEUE_DEPTH", 8, minimum=1)  # waiting per ready replica
# A replica above what its deployment reserves (models_catalog.services.reserved_replicas), idle
# this long, gives its slot to a deployment that has no replica and finds no free slot.
FLEET_EVICT_IDLE_SECONDS = env_seconds("FLEET_EVICT_IDLE_SECONDS", "60", minimum=0)
FLEET_LOAD_TIMEOUT = env_seconds("FLEET_LOAD_TIMEOUT", "600", minimum=1)  # a load taking longer fails
FLEET_DRAIN_TIMEOUT = env_seconds("FLEET_DRAIN_TIMEOUT", "600", minimum=0)  # unload waits for requests
# A request to a deployment with no replica waits this long for one to load (a cold start).
FLEET_COLD_START_TIMEOUT = env_seconds("FLEET_COLD_START_TIMEOUT", "120", minimum=0)
# The engines a worker loads: on a GPU, the share of the memory free after the weights that the KV
# cache, step activations and CUDA graphs may take together (unset: the engine's default, 0.9);
# ENGINE_CUDA_GRAPHS=false runs decode steps eagerly instead of replaying CUDA graphs.
def _env_fraction(name: str) -> float | None:
    raw = env_str(name).strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number in (0, 1], not {raw!r}") from None
    if not 0 < value <= 1:
        raise ImproperlyConfigured(f"{name} must be a number in (0, 1], not {raw!r}")
    return value


ENGINE_KV_MEMORY_FRACTION = _env_fraction("ENGINE_KV_MEMORY_FRACTION")
ENGINE_CUDA_GRAPHS = env_bool("ENGINE_CUDA_GRAPHS", True)
METRICS_TOKEN = env_str("METRICS_TOKEN")  # Prometheus scrapes /metrics with "Authorization: Bearer <token>"
# What /metrics reads at scrape time, one collector per app (so that no app imports another's).
METRICS_COLLECTORS = ["workers.metrics.FleetCollector", "billing.metrics.BillingCollector"]
CELERY_BEAT_SCHEDULE = {
    "fleet-tick": {
        "task": "workers.fleet_tick",
        "schedule": FLEET_TICK_SECONDS,
        "options": {"queue": "default", "expires": max(5.0, FLEET_TICK_SECONDS * 5)},
    },
    "meter-reserved-capacity": {
        "task": "workers.meter_reserved_capacity",
        "schedule": 60.0,
        "options": {"queue": "default", "expires": 50.0},
    },
    "resume-batches": {
        "task": "gateway.resume_batches",
        "schedule": 60.0,
        "options": {"queue": "default", "expires": 50.0},
    },
    "purge-expired-batch-files": {
        "task": "gateway.purge_expired_batch_files",
        "schedule": 3600.0,
        "options": {"queue": "default", "expires": 600.0},
    },
    "purge-expired-responses": {
        "task": "gateway.purge_expired_responses",
        "schedule": 3600.0,
        "options": {"queue": "default", "expires": 600.0},
    },
}
# kombu returns unacknowledged messages older than the visibility timeout to their queue on
# periodic sweeps: every interval * throttle seconds (lower both with a low visibility timeout).
CELERY_BROKER_TRANSPORT_OPTIONS["unacked_restore_interval"] = env_int("CELERY_UNACKED_RESTORE_INTERVAL", 10, minimum=1)
CELERY_BROKER_TRANSPORT_OPTIONS["unacked_restore_throttle"] = env_int("CELERY_UNACKED_RESTORE_THROTTLE", 10, minimum=1)
# The deployments API's "kind" enum, named apart from billing's ledger "kind" in the OpenAPI document.
SPECTACULAR_SETTINGS.setdefault("ENUM_NAME_OVERRIDES", {})["DeploymentKindEnum"] = "models_catalog.models.Deployment.Kind"
# --- end worker fleet -----------------------------------------------------------------------------
