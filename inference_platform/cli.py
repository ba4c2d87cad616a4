"""``inference-platform``: the operator's command line.

    up       everything in the foreground on the embedded defaults (Ctrl-C stops it all)
    web      the ASGI web server alone
    worker   one Celery worker alone
    beat     the periodic tasks alone (Celery beat): fleet placement, the purge of old responses
    createkey  create an API key and print it
"""

from __future__ import annotations

import argparse
import errno
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .celery import deployment_queue
from .processes import (STAGE_BILLING, STOP_GRACE_S, StartError, child_env, describe, spawn, start_embedded_redis,
                        web_command, worker_command)
from .supervision import shut_down, supervise

DEFAULT_QUEUES = ["default", "billing"]
BILLING_CONCURRENCY = 4  # threads of the billing worker `up` starts
BATCH_RUNNERS = 4  # threads of the batch worker `up` starts: batches run at once
ADMIN_EMAIL = "admin@localhost"
DEFAULT_ORG = "default"
DEFAULT_SCOPES = ["inference", "read_usage"]


class Abort(Exception):
    """A clean, one-line reason to stop."""


def setup_django():
    """Load settings, turning configuration mistakes into one line instead of a traceback."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    from django.core.exceptions import ImproperlyConfigured

    try:
        import django

        django.setup()
    except ImproperlyConfigured as exc:
        raise Abort(str(exc)) from None
    from django.conf import settings

    try:
        # Its own user's only: it holds the SQLite database (password hashes, sessions, stored
        # responses), the logs and the operator's key. A folder given that exists keeps its mode
        # (it may be a mount), said if others may enter it; what is written in it is ours only.
        settings.DATA_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
        mode = settings.DATA_DIR.stat().st_mode & 0o777
    except OSError as exc:
        raise Abort(f"cannot create the data folder {settings.DATA_DIR}: {exc.strerror} (set DATA_DIR to a "
                    "writable folder)") from None
    if mode & 0o077:
        print(f"warning: other users of this machine may enter the data folder {settings.DATA_DIR} (mode "
              f"{mode:o}), which holds the database, logs and keys: "
              f"`chmod 700 {settings.DATA_DIR}`", file=sys.stderr)
    return settings


def lock_data_dir(data_dir: Path):
    """One `up` per data folder (a second would share its Redis and fight over the same worker
    names). Returns the open lock file: the lock lasts while it stays open, i.e. while this process
    lives, however it ends."""
    import fcntl

    handle = open(data_dir / "up.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise Abort(f"another `inference-platform up` (pid {holder}) is running on {data_dir}: stop it first, "
                    "or set DATA_DIR to another folder") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def require_database(settings, *, existing: bool = False) -> None:
    """Abort unless the database answers. ``existing``: a command that only uses a database `up`
    made: an SQLite file that is not there is said so, not created empty by the check."""
    from django.db import connection

    from .env import redact_url
    from .readiness import check_database

    if existing and connection.vendor == "sqlite":
        name = Path(settings.DATABASES["default"]["NAME"])
        if not name.exists():
            raise Abort(f"there is no database at {name} yet: run `inference-platform up` first (it creates and "
                        "migrates it), or set DATA_DIR or DATABASE_URL to the platform's")

    result = check_database(connection)
    if not result["ok"]:
        where = redact_url(os.environ.get("DATABASE_URL", "")) or f"sqlite:///{settings.DATABASES['default']['NAME']}"
        raise Abort(f"cannot reach the database at {where}: {result['error']} (is it running? check DATABASE_URL)")


def require_redis(settings) -> None:
    from .readiness import check_redis

    result = check_redis(settings.REDIS_URL)
    if not result["ok"]:
        raise Abort(f"cannot reach Redis at {result['url']}: {result['error']} (is it running? check REDIS_URL)")


def ensure_redis(settings, procs: list, *, alone: bool = False) -> None:
    """Start the embedded Redis when REDIS_URL is unset, else check the configured one answers.
    ``alone``: a command that runs one part of the platform (``web``, ``worker``, ``beat``), whose
    embedded Redis the other parts, started apart, come to share."""
    if settings.REDIS_IS_EMBEDDED:
        try:
            proc = start_embedded_redis(settings.EMBEDDED_REDIS_SOCKET, data_dir=settings.DATA_DIR)
        except StartError as exc:
            raise Abort(str(exc)) from None
        if proc:
            procs.append(proc)
            say(f"started the embedded Redis on {settings.REDIS_URL}")
            from workers.fleet import forget_requests_of_a_stopped_platform

            forgotten = forget_requests_of_a_stopped_platform()  # it keeps its data across a stop
            if forgotten:
                say(f"dropped {forgotten} requests queued when the platform last stopped (their clients are gone)")
            if alone:
                say("note: it stops when this command stops, and with it the broker of any other part started "
                    "on this data folder; to run the parts apart, set REDIS_URL to a Redis of your own "
                    "(or use `inference-platform up`)")
    require_redis(settings)


def ensure_admin(settings) -> str | None:
    """Create the first operator account on a fresh install; returns its password the first time."""
    from django.contrib.auth import get_user_model

    users = get_user_model()
    if users.objects.filter(is_superuser=True).exists():
        return None
    password = secrets.token_urlsafe(12)
    users.objects.create_superuser(email=ADMIN_EMAIL, password=password)
    path = settings.DATA_DIR / "admin-password.txt"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return password


def require_migrated() -> None:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        raise Abort("the database has unapplied migrations: run `inference-platform up` (or `manage.py migrate`) first")


def make_api_key(*, org_name: str, email: str | None, scopes: list[str], name: str) -> tuple[str, list[str]]:
    """A new key for the organization ``org_name`` (created, owned by ``email``, when missing).
    Returns the key and what was created, for the operator."""
    from django.contrib.auth import get_user_model
    from django.db import transaction

    from accounts.errors import InvalidInput
    from accounts.models import ApiKey, Membership, Organization
    from accounts.services import add_member, create_api_key, create_organization, create_user

    users = get_user_model()
    notes: list[str] = []
    try:
        with transaction.atomic():
            user = None
            if email:
                user = users.objects.filter(email__iexact=email).first()
                if user is None:
                    user = create_user(email=email, password=None)
                    notes.append(f"created the user {user.email} (no password yet: set one with `manage.py changepassword {user.email}`)")
            organization = Organization.objects.filter(name=org_name).first() or Organization.objects.filter(slug=org_name).first()
            if organization is None:
                if user is None:
                    user = users.objects.filter(email__iexact=ADMIN_EMAIL).first() or users.objects.filter(is_superuser=True).order_by("pk").first()
                    if user is None:
                        raise Abort("no user to own the new organization: pass --email")
                organization = create_organization(name=org_name, owner=user)
                notes.append(f"created the organization {organization.name!r} owned by {user.email}")
            elif user is not None and not Membership.objects.filter(organization=organization, user=user).exists():
                # A key acts with its creator's role: an admin's only for a key that manages.
                role = Membership.Role.ADMIN if "manage" in scopes else Membership.Role.MEMBER
                add_member(organization=organization, user=user, role=role)
                notes.append(f"added {user.email} to {organization.name!r} as {'an admin' if role == 'admin' else 'a member'}")
            if user is None:
                owner = organization.memberships.filter(role=Membership.Role.OWNER).select_related("user").first()
                user = owner.user if owner else None
            api_key, raw = create_api_key(organization=organization, name=name, scopes=scopes, created_by=user,
                                          origin=ApiKey.Origin.COMMAND_LINE)
    except InvalidInput as exc:
        raise Abort(f"{exc.field}: {exc.message}") from None
    notes.append(f"created the API key {api_key.name!r} ({api_key.display_prefix}) for {organization.name!r} "
                 f"with scopes {', '.join(api_key.scopes)}")
    return raw, notes


def ensure_api_key(settings) -> str:
    """The key `up` prints: saved (0600) in DATA_DIR/api-key.txt the first time, reprinted later while
    it still works."""
    from accounts.errors import ApiKeyError
    from accounts.selectors import authenticate_api_key

    path = settings.DATA_DIR / "api-key.txt"
    if path.exists():
        raw = path.read_text().strip()
        try:
            authenticate_api_key(raw)
            return raw
        except ApiKeyError:
            pass  # a fresh database, or the key was revoked: make a new one
    raw, _ = make_api_key(org_name=DEFAULT_ORG, email=ADMIN_EMAIL, scopes=["inference", "read_usage", "manage"], name="up")
    path.write_text(raw + "\n")
    path.chmod(0o600)
    return raw


def seed(settings) -> None:
    """Run every seeding command that exists so far (the catalog arrives with its issue)."""
    from django.core.management import call_command, get_commands

    if "seed_catalog" in get_commands():
        call_command("seed_catalog")


def served_deployments() -> list[str]:
    """The deployments the embedded worker serves: every public one but those stopped. One that
    failed to load is tried again, as a start is the operator's way to say "again" (its weights
    may be back)."""
    from models_catalog.models import Deployment
    from models_catalog.services import retry_if_failed

    public = Deployment.objects.filter(is_public=True).exclude(status=Deployment.Status.STOPPED).order_by("name")
    for deployment in public.filter(status=Deployment.Status.FAILED):
        retry_if_failed(deployment=deployment, why="the platform started again")
    return list(public.values_list("name", flat=True))


def _abort_if_one_exited(procs: list[subprocess.Popen], when: str) -> None:
    for proc in procs:
        if proc.poll() is not None:
            raise Abort(f"{describe(proc)} exited with code {proc.returncode} {when}")


def wait_ready(url: str, procs: list[subprocess.Popen], *, deadline_s: float) -> None:
    give_up = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < give_up:
        _abort_if_one_exited(procs, "while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            last = "web server not answering yet"
        time.sleep(0.25)
    raise Abort(f"the platform was not ready within {deadline_s:g}s: {last}")


def wait_loaded(names: list[str], worker: str, procs: list[subprocess.Popen], *, deadline_s: float,
                since=None) -> dict[str, str]:
    """Wait until ``worker`` has loaded every deployment in ``names`` (its engines answer Celery's
    remote control), so that the first request does not wait for a model load. One whose load
    failed (the fleet records it, after ``since``) is not waited for: the platform starts without
    it (it is marked failed, with the reason). Returns those failures' reasons, by name."""
    from workers.models import FleetEvent

    from .celery import app

    give_up = time.monotonic() + deadline_s
    failures: dict[str, str] = {}
    loaded: set[str] = set()
    while time.monotonic() < give_up:
        _abort_if_one_exited(procs, "while loading")
        failed = FleetEvent.objects.filter(kind=FleetEvent.Kind.FAILED, worker=worker, deployment_name__in=names)
        if since is not None:
            failed = failed.filter(created_at__gte=since)
        for name, message in failed.order_by("created_at").values_list("deployment_name", "message"):
            failures.setdefault(name, message)
        try:
            replies = app.control.broadcast("engine_stats", reply=True, timeout=1.0, destination=[worker])
        except Exception:  # the broker is briefly unreachable: ask again
            replies = []
        loaded = {name for reply in replies for node in reply.values() for name in node.get("engines", {})}
        if loaded | failures.keys() >= set(names):
            return failures
        time.sleep(0.5)
    missing = [name for name in names if name not in loaded and name not in failures]
    raise Abort(f"the worker did not load {', '.join(missing)} within {deadline_s:g}s: see its log")


def free_port(host: str, port: int) -> None:
    """Abort unless the web server will be able to listen on ``host``:``port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is free
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            raise Abort(f"cannot listen on {host!r}: {exc.strerror}") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise Abort(f"port {port} on {host} is in use: choose another with --port") from None
            raise Abort(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def refuse_debug_off_loopback(settings, host: str) -> None:
    """Debug mode (the embedded defaults) shows a traceback with the settings for any error; only
    this machine may see that."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if settings.DEBUG and not loopback:
        raise Abort(f"debug mode (DEBUG=true, the default) shows error pages with tracebacks and settings, so the "
                    f"web server listens on this machine only: to serve {host}, set DEBUG=false with SECRET_KEY "
                    "and ALLOWED_HOSTS (see .env.example), or leave --host at 127.0.0.1")


def production_gaps(settings) -> list[str]:
    """What a production start (DEBUG=false) still leaves to the development defaults, said at start:
    it runs, but users would miss it."""
    if settings.DEBUG:
        return []
    gaps = []
    if settings.EMAIL_BACKEND.endswith("console.EmailBackend"):
        gaps.append("EMAIL_BACKEND is the console's: invitations, address confirmations and password resets go to "
                    "this process's output, not to their users (set the SMTP backend, see EMAIL_HOST)")
    if not settings.SITE_URL:
        gaps.append("SITE_URL is unset: links in emails use the host each request named")
    if not settings.HTTPS:
        gaps.append("HTTPS is off: cookies are not Secure and there is no HSTS (set HTTPS=true behind TLS)")
    return gaps


def say_production_gaps(settings) -> None:
    for gap in production_gaps(settings):
        print(f"warning: {gap}", file=sys.stderr)


def local_url(host: str, port: int) -> str:
    """Where this machine reaches the web server: a wildcard address is one to listen on, not to
    connect to (and its Host header is none that ALLOWED_HOSTS lists)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def own_site_url(host: str, port: int) -> str:
    """OWN_SITE_URL, where emails sent without a request link when SITE_URL is unset: this
    machine's address when it listens on one alone (one that listens on every address has none
    that others surely reach: no link then)."""
    return "" if host in ("0.0.0.0", "", "::") else local_url(host, port)


def port_number(value: str) -> int:
    """argparse type: a TCP port."""
    if not value.isdecimal() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number (1-65535)")
    return int(value)


def counting(minimum: int):
    """argparse type: a whole number of at least ``minimum``."""
    def parse(value: str) -> int:
        if not value.isdecimal() or int(value) < minimum:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least {minimum}")
        return int(value)

    return parse


def seconds(value: str) -> float:
    """argparse type: a positive number of seconds."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return number


def say(message: str) -> None:
    print(message, flush=True)


def wait_billing_drained(forced=lambda: False, deadline_s: float = 30.0) -> None:
    """Before the billing worker stops: until the usage the other workers emitted as they stopped
    is recorded (the embedded Redis keeps nothing once it stops), within ``deadline_s``, or until
    the stop is ``forced``."""
    from billing.recovery import pending_events
    from inference_platform.celery import app

    give_up = time.monotonic() + deadline_s
    try:
        while (left := pending_events(app)) and time.monotonic() < give_up and not forced():
            time.sleep(0.2)
    except Exception as exc:  # Redis already gone: nothing left to wait for
        say(f"warning: could not check the billing queue: {exc}")
        return
    if left:
        say(f"warning: {left} usage events were not recorded yet; they stay in Redis "
            "(an embedded Redis loses them when it stops)")


def drain_timeout(settings) -> float:
    """How long a stopping inference worker may take to finish its running requests: the drain
    timeout of an unload (FLEET_DRAIN_TIMEOUT), and never less than any other child's grace."""
    return max(float(settings.FLEET_DRAIN_TIMEOUT), STOP_GRACE_S)


def spawn_web(settings, *, host: str, port: int, workers: int, env: dict, log: Path | None = None) -> subprocess.Popen:
    """The web server. A stop lets it keep streaming the answers already open (it takes no new
    connection) for as long as the inference workers drain, and its own timeout ends them first."""
    drain = drain_timeout(settings)
    web = spawn(web_command(host=host, port=port, workers=workers, graceful_s=drain), env=env, log=log,
                role="the web server")
    web.stop_grace_s = drain + STOP_GRACE_S
    return web


def drains_on_stop(proc: subprocess.Popen, settings, worker: str) -> subprocess.Popen:
    """Give the inference worker ``proc`` (Celery node ``worker``) the drain timeout to stop in,
    and the words for what it finishes meanwhile (see ``processes.stop_all``)."""
    from celery.utils.nodenames import host_format

    node = host_format(worker)  # as the worker names itself (and its heartbeats): gpu0@%h -> gpu0@<host>
    proc.stop_grace_s = drain_timeout(settings)
    proc.waiting_for = lambda: _finishing(node)
    return proc


def _finishing(worker: str) -> str | None:
    """What the stopping inference worker ``worker`` finishes, in words; None when it runs no request."""
    count = _running_requests(worker)
    if count == 0:
        return None  # its shutdown takes a moment, but no request waits on it
    if count is None:  # not a fleet worker, or the database or Redis did not say
        return "the inference worker to finish its running requests"
    return f"the inference worker to finish its {count} running request{'' if count == 1 else 's'}"


def _running_requests(worker: str, timeout_s: float = 2.0) -> int | None:
    """How many requests the fleet worker ``worker`` holds right now (the requests its process took
    and has not finished: ``workers.fleet``'s record of them, which outlives a stale heartbeat);
    None when unknown. Asked in a thread, given ``timeout_s``: the platform is stopping, and its
    database or Redis may be gone."""
    found: list[int] = []

    def count() -> None:
        from django.db import connection

        try:
            from workers import fleet
            from workers.models import Worker

            instance = Worker.objects.filter(hostname=worker).values_list("instance", flat=True).first()
            if instance:
                found.append(fleet.held_count(instance))
        except Exception:
            pass
        finally:
            connection.close()

    thread = threading.Thread(target=count, name="running-requests", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return found[0] if found else None


def cmd_up(args) -> int:
    settings = setup_django()
    lock = lock_data_dir(settings.DATA_DIR)  # noqa: F841 (held until this process ends)
    procs: list[subprocess.Popen] = []
    try:
        refuse_debug_off_loopback(settings, args.host)
        say_production_gaps(settings)
        free_port(args.host, args.port)
        say("[1/5] Redis")
        ensure_redis(settings, procs)
        say("[2/5] database: migrating")
        require_database(settings)
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)
        say("[3/5] seeding")
        seed(settings)
        password = ensure_admin(settings)
        api_key = ensure_api_key(settings)
        say(f"[4/5] starting the web server on http://{args.host}:{args.port}, a worker, a billing worker and a batch worker")
        served = served_deployments()
        worker_name = f"worker@{socket.gethostname()}"
        # Every part's: the billing worker's emails link to this server too.
        common = {"DATA_DIR": str(settings.DATA_DIR), "OWN_SITE_URL": own_site_url(args.host, args.port)}
        slots = max(args.slots, len(served))
        env = child_env(**common, INFERENCE_PRELOAD=",".join(served), WORKER_SLOTS=str(slots))
        logs = settings.DATA_DIR / "logs"
        logs.mkdir(exist_ok=True)
        from django.utils import timezone

        spawned_at = timezone.now()
        # A stop lets the inference worker finish its running requests (up to the drain timeout),
        # and the web server keep streaming them meanwhile (it takes no new connection).
        procs.append(spawn_web(settings, host=args.host, port=args.port, workers=args.web_workers, env=env,
                               log=logs / "web.log"))
        # Two workers, as in compose.yaml: the engine's process runs inference alone, and billing's
        # writes run in a process of their own instead of taking turns with the engine's loop.
        procs.append(drains_on_stop(
            spawn(
                worker_command(queues=["default"] + [deployment_queue(d) for d in served],
                               concurrency=args.concurrency or default_concurrency(slots=slots, other_queues=1),
                               name=worker_name),
                env=env,
                log=logs / "worker.log",
                role="the inference worker",
            ),
            settings, worker_name,
        ))
        billing = spawn(
            worker_command(queues=DEFAULT_QUEUES, concurrency=BILLING_CONCURRENCY,
                           name=f"billing@{socket.gethostname()}"),
            env=child_env(**common, WORKER_SLOTS="0"),
            log=logs / "billing.log",
            role="the billing worker",
            # Out of the terminal's process group, as the embedded Redis: a Ctrl-C would stop it at
            # once, before it records the usage of the requests the inference worker finishes.
            own_session=True,
        )
        billing.stop_stage, billing.before_stop = STAGE_BILLING, wait_billing_drained
        procs.append(billing)
        procs.append(spawn(  # the Batch API's runners: a process of their own, as their batches last
            worker_command(queues=["batches"], concurrency=BATCH_RUNNERS, name=f"batches@{socket.gethostname()}"),
            env=child_env(**common, WORKER_SLOTS="0"),
            log=logs / "batches.log",
            role="the batch worker",
        ))
        procs.append(spawn(beat_command(settings), env=env, log=logs / "beat.log", role="the placement loop (beat)"))
        say(f"[5/5] waiting for /readyz and for the worker to load {', '.join(served) or 'nothing'}")
        base = local_url(args.host, args.port)
        started = time.monotonic()
        wait_ready(f"{base}/readyz", procs, deadline_s=args.ready_timeout)
        failures = wait_loaded(served, worker_name, procs, since=spawned_at,
                               deadline_s=max(1.0, args.ready_timeout - (time.monotonic() - started)))
        for name, why in failures.items():
            say(f"warning: {name} could not be loaded, and is marked failed (start it again from its page once "
                f"that is fixed): {why}")
    except (Abort, KeyboardInterrupt) as exc:
        shut_down(procs, say=say, announce=False)
        if isinstance(exc, KeyboardInterrupt):
            return 130
        raise
    password_file = settings.DATA_DIR / "admin-password.txt"
    login = f"{ADMIN_EMAIL} / {password}  (also in {password_file})" if password else \
        f"{ADMIN_EMAIL} (password in {password_file})"
    say("")
    say(f"  Dashboard:  {base}/")
    say(f"  Log in as:  {login}")
    say(f"  API key:    {api_key}  (also in {settings.DATA_DIR / 'api-key.txt'})")
    say("  Try it:")
    say(f"    curl {base}/v1/chat/completions -H \"Authorization: Bearer {api_key}\" "
        "-H \"Content-Type: application/json\" "
        "-d '{\"model\": \"smollm2-135m-instruct\", \"max_tokens\": 64, "
        "\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'")  # a bound: a small model may ramble
    say(f"  Logs:       {logs}")
    say("  Ready. Press Ctrl-C to stop everything.")
    say("")
    return supervise(procs, say=say)


def cmd_web(args) -> int:
    settings = setup_django()
    refuse_debug_off_loopback(settings, args.host)
    say_production_gaps(settings)
    procs: list[subprocess.Popen] = []
    ensure_redis(settings, procs, alone=True)
    require_database(settings)
    free_port(args.host, args.port)
    procs.append(spawn_web(settings, host=args.host, port=args.port, workers=args.workers, env=child_env()))
    say(f"web server on http://{args.host}:{args.port}")
    return supervise(procs, say=say)


def beat_command(settings) -> list[str]:
    """Celery beat: runs the fleet's placement loop every FLEET_TICK_SECONDS, and purges old stored
    responses hourly."""
    return [
        sys.executable, "-m", "celery", "-A", "inference_platform", "beat", "--loglevel", "WARNING",
        "--schedule", str(settings.DATA_DIR / "celerybeat-schedule"),
    ]


def cmd_beat(args) -> int:
    settings = setup_django()
    procs: list[subprocess.Popen] = []
    ensure_redis(settings, procs, alone=True)
    require_database(settings)
    procs.append(spawn(beat_command(settings), env=child_env()))
    say(f"placement loop every {settings.FLEET_TICK_SECONDS:g}s")
    return supervise(procs, say=say)


def default_concurrency(*, slots: int, other_queues: int) -> int:
    """Threads enough to fill the batches of ``slots`` deployments of the default batch size, as
    the worker takes requests for them (``reservations``): with fewer, a second deployment placed
    on it batches less, and the worker warns. Idle threads cost little."""
    from models_catalog.models import Deployment
    from workers.reservations import reserve_for

    batch_size = Deployment._meta.get_field("max_batch_size").default
    return max(64, slots * reserve_for(batch_size) + other_queues)


def cmd_worker(args) -> int:
    settings = setup_django()
    procs: list[subprocess.Popen] = []
    ensure_redis(settings, procs, alone=True)
    require_database(settings)
    name = args.name or f"worker-{os.getpid()}@{socket.gethostname()}"
    queues = args.queues + [deployment_queue(d) for d in args.deployments]
    slots = args.slots
    if slots is None:  # WORKER_SLOTS, read (and checked) by the settings, when it is set
        slots = settings.WORKER_SLOTS if os.environ.get("WORKER_SLOTS", "").strip() else max(1, len(args.deployments))
    env = child_env(INFERENCE_PRELOAD=",".join(args.deployments), WORKER_SLOTS=str(slots))
    inference = slots > 0 or bool(args.deployments)
    concurrency = args.concurrency or default_concurrency(slots=slots, other_queues=len(args.queues))
    worker = spawn(worker_command(queues=queues, concurrency=concurrency, name=name), env=env,
                   role="the inference worker" if inference else "the worker")
    if inference:  # a stop lets its running requests finish, up to the drain timeout
        drains_on_stop(worker, settings, name)
    procs.append(worker)
    return supervise(procs, say=say)


def cmd_createkey(args) -> int:
    settings = setup_django()
    require_database(settings, existing=True)
    require_migrated()
    scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
    raw, notes = make_api_key(org_name=args.org, email=args.email, scopes=scopes, name=args.name)
    for note in notes:
        print(note, file=sys.stderr)
    print(raw, flush=True)
    return 0


def cmd_import_model(args) -> int:
    settings = setup_django()
    require_database(settings, existing=True)
    require_migrated()
    from django.core.management import CommandError, call_command

    options = {name: getattr(args, name) for name in ("slug", "display_name", "description", *IMPORT_PRICES)}
    try:
        call_command("import_model", args.path, **options)  # manage.py's, which does the import
    except CommandError as exc:
        raise Abort(str(exc)) from None
    return 0


# The catalog's PRICE_FIELDS, named here: the parser is built before Django is set up.
IMPORT_PRICES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_per_request",
                 "price_per_replica_hour")
PRICE_UNITS = {"price_per_request": "per request", "price_per_replica_hour": "per hour of a replica an organization "
               "keeps up (its dedicated deployments', whose requests are then free, and min_replicas)"}


# What an operator most often sets; the README's Settings lists every one.
SETTINGS_EPILOG = """settings (environment variables; the README's Settings section lists them all):
  DATA_DIR       SQLite file, embedded Redis socket, logs, the saved key (default: .data in the checkout)
  DATABASE_URL   postgresql://user:pass@host:5432/name (default: SQLite in DATA_DIR)
  REDIS_URL      redis://host:6379/0 (default: a private Redis on a socket in DATA_DIR, started here)
  DEBUG          true (default) for development; false needs SECRET_KEY and ALLOWED_HOSTS
  LOG_LEVEL      INFO (default), DEBUG, WARNING, ..."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-platform",
        description="Run the self-hosted inference platform. Settings come from environment variables (see the README).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start everything in the foreground (Redis, migrations, web, worker)",
                        description="Start the whole platform on its embedded defaults; Ctrl-C stops it all.",
                        epilog=SETTINGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--host", default="127.0.0.1", help="address the web server listens on (default 127.0.0.1)")
    up.add_argument("--port", type=port_number, default=8000, help="web server port (default 8000)")
    up.add_argument("--concurrency", type=counting(1), default=None,
                    help="worker threads (default: enough to fill the batches of --slots deployments, at least 64)")
    up.add_argument("--web-workers", type=counting(1), default=1, help="web server processes (default 1)")
    up.add_argument("--ready-timeout", type=seconds, default=180.0, help="seconds to wait for /readyz and the worker's model load (default 180)")
    up.add_argument("--slots", type=counting(0), default=4,
                    help="deployments the worker may host at once; the placement loop fills them (default 4)")
    up.set_defaults(func=cmd_up)

    web = sub.add_parser("web", help="start the ASGI web server only", description="Start the ASGI web server (HTTP + WebSocket).",
                         epilog=SETTINGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    web.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    web.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    web.add_argument("--workers", type=counting(1), default=1, help="web server processes (default 1)")
    web.set_defaults(func=cmd_web)

    worker = sub.add_parser("worker", help="start one Celery worker", description="Start one Celery worker process (thread pool, late acks; it takes from the queue what the engines it hosts can run).",
                            epilog=SETTINGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker.add_argument("--queues", type=lambda s: [q for q in s.split(",") if q], default=DEFAULT_QUEUES,
                        help="comma-separated queues to consume (default: default,billing)")
    worker.add_argument("--deployments", type=lambda s: [d for d in s.split(",") if d], default=[],
                        help="comma-separated deployments to serve: their queues are consumed and their models loaded at start")
    worker.add_argument("--concurrency", type=counting(1), default=None,
                        help="worker threads; at least the engine's max batch size (default: enough to fill the "
                             "batches of --slots deployments, at least 64)")
    worker.add_argument("--name", default="", help="Celery node name (default worker-PID@HOST)")
    worker.add_argument("--slots", type=counting(0), default=None,
                        help="deployments this worker may host at once, placed by the fleet's placement loop "
                             "(default: WORKER_SLOTS if set, else 1 or the number of --deployments); "
                             "0: not an inference worker (billing only)")
    worker.set_defaults(func=cmd_worker)

    beat = sub.add_parser("beat", help="run the periodic tasks (Celery beat): the fleet's placement loop, the meter of "
                                       "reserved capacity, the purge of old stored responses",
                          description="Start Celery beat, which runs the placement loop (workers.fleet_tick) every "
                                      "FLEET_TICK_SECONDS: heartbeats checked, deployments placed, idle ones scaled "
                                      "to zero; and every minute, the meter that bills reserved replicas. Run exactly "
                                      "one.",
                          epilog=SETTINGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    beat.set_defaults(func=cmd_beat)

    createkey = sub.add_parser(
        "createkey", help="create an API key and print it (alone, on stdout)",
        description="Create an API key for an organization, creating the organization and the user when "
                    "missing. The key alone goes to stdout (it is shown only this once); notes go to stderr.",
        epilog=SETTINGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    createkey.add_argument("--org", default=DEFAULT_ORG, help=f"organization name (default {DEFAULT_ORG!r}; created when missing)")
    createkey.add_argument("--email", default=None,
                           help=f"the user the key is created for (created when missing, and added to an existing "
                                f"organization as a member, or as an admin for a key with the manage scope); default: "
                                f"the organization's owner, or {ADMIN_EMAIL} for a new organization")
    createkey.add_argument("--scopes", default=",".join(DEFAULT_SCOPES),
                           help=f"comma-separated scopes among inference, read_usage, manage (default {','.join(DEFAULT_SCOPES)})")
    createkey.add_argument("--name", default="cli", help="a name for the key (default 'cli')")
    createkey.set_defaults(func=cmd_createkey)

    imports = sub.add_parser(
        "import-model", help="add a GGUF file or a Hugging Face safetensors folder to the catalog",
        description="Add the weights at PATH (under MODELS_ROOT) to the catalog, reading their architecture, size, "
                    "quantization and context length; refused, with the reason, when the engine could not run them "
                    "(an unsupported architecture, no tokenizer, a file cut short). Deploy it from the dashboard or "
                    "with POST /v1/deployments.",
        epilog=SETTINGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    imports.add_argument("path", help="the weights file or folder, absolute or relative to MODELS_ROOT")
    imports.add_argument("--slug", default=None, help="catalog slug (default: from the file name)")
    imports.add_argument("--display-name", default=None, help="name shown in the catalog (default: from the file)")
    imports.add_argument("--description", default="", help="description shown in the catalog")
    for field in IMPORT_PRICES:
        imports.add_argument(f"--{field.replace('_', '-')}", dest=field, default=None,
                             help=f"USD {PRICE_UNITS.get(field, 'per million tokens')} (default 0; at most 6 "
                                  "decimal places)")
    imports.set_defaults(func=cmd_import_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.umask(0o077)  # what this writes (the SQLite database, logs, mail, imported weights) is its user's only
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Abort as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while starting: the children die with this process (PDEATHSIG)
        return 130


if __name__ == "__main__":
    sys.exit(main())
