"""``inference-platform``: the operator's command line.

    up       everything in the foreground on the embedded defaults (Ctrl-C stops it all)
    web      the ASGI web server alone
    worker   one Celery worker alone
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from .processes import StartError, child_env, spawn, start_embedded_redis, stop_all, web_command, worker_command

DEFAULT_QUEUES = ["default", "billing"]


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

    settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
    return settings


def require_database(settings) -> None:
    from django.db import connection

    from .env import redact_url
    from .readiness import check_database

    result = check_database(connection)
    if not result["ok"]:
        where = redact_url(os.environ.get("DATABASE_URL", "")) or f"sqlite:///{settings.DATABASES['default']['NAME']}"
        raise Abort(f"cannot reach the database at {where}: {result['error']} (is it running? check DATABASE_URL)")


def require_redis(settings) -> None:
    from .readiness import check_redis

    result = check_redis(settings.REDIS_URL)
    if not result["ok"]:
        raise Abort(f"cannot reach Redis at {result['url']}: {result['error']} (is it running? check REDIS_URL)")


def ensure_redis(settings, procs: list) -> None:
    """Start the embedded Redis when REDIS_URL is unset, else check the configured one answers."""
    if settings.REDIS_IS_EMBEDDED:
        try:
            proc = start_embedded_redis(settings.EMBEDDED_REDIS_SOCKET, data_dir=settings.DATA_DIR)
        except StartError as exc:
            raise Abort(str(exc)) from None
        if proc:
            procs.append(proc)
            say(f"started the embedded Redis on {settings.REDIS_URL}")
    require_redis(settings)


def ensure_admin(settings) -> str | None:
    """Create the first operator account on a fresh install; returns its password the first time."""
    from django.contrib.auth import get_user_model

    users = get_user_model()
    if users.objects.filter(is_superuser=True).exists():
        return None
    password = secrets.token_urlsafe(12)
    users.objects.create_superuser(username="admin", email="admin@localhost", password=password)
    path = settings.DATA_DIR / "admin-password.txt"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return password


def seed(settings) -> None:
    """Run every seeding command that exists so far (the catalog arrives with its issue)."""
    from django.core.management import call_command, get_commands

    if "seed_catalog" in get_commands():
        call_command("seed_catalog")


def wait_ready(url: str, procs: list[subprocess.Popen], *, deadline_s: float) -> None:
    give_up = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < give_up:
        for proc in procs:
            if proc.poll() is not None:
                raise Abort(f"{' '.join(proc.args[:4])} exited with code {proc.returncode} while starting")
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


def free_port(host: str, port: int) -> None:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            raise Abort(f"port {port} on {host} is in use: choose another with --port") from None


def say(message: str) -> None:
    print(message, flush=True)


def supervise(procs: list[subprocess.Popen]) -> int:
    """Wait until Ctrl-C or SIGTERM, or until a child dies; then stop every child."""
    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        while stopping["signal"] is None:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                say(f"error: {' '.join(dead[0].args[:4])} exited with code {dead[0].returncode}; stopping")
                code = 1
                break
            time.sleep(0.2)
    finally:
        say("stopping...")
        stop_all(list(reversed(procs)))
        say("stopped")
    return code


def cmd_up(args) -> int:
    settings = setup_django()
    procs: list[subprocess.Popen] = []
    try:
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
        say(f"[4/5] starting the web server on http://{args.host}:{args.port} and a worker")
        env = child_env(DATA_DIR=str(settings.DATA_DIR))
        logs = settings.DATA_DIR / "logs"
        logs.mkdir(exist_ok=True)
        procs.append(spawn(web_command(host=args.host, port=args.port), env=env, log=logs / "web.log"))
        procs.append(
            spawn(
                worker_command(queues=DEFAULT_QUEUES, concurrency=args.concurrency, name=f"worker@{socket.gethostname()}"),
                env=env,
                log=logs / "worker.log",
            )
        )
        say("[5/5] waiting for /readyz")
        base = f"http://{args.host}:{args.port}"
        wait_ready(f"{base}/readyz", procs, deadline_s=args.ready_timeout)
    except (Abort, KeyboardInterrupt) as exc:
        stop_all(procs)
        if isinstance(exc, KeyboardInterrupt):
            return 130
        raise
    login = f"admin / {password}" if password else f"admin (password in {settings.DATA_DIR / 'admin-password.txt'})"
    say("")
    say(f"  Dashboard:  {base}/")
    say(f"  Log in as:  {login}")
    say(f"  Logs:       {logs}")
    say("  Ready. Press Ctrl-C to stop everything.")
    say("")
    return supervise(procs)


def cmd_web(args) -> int:
    settings = setup_django()
    procs: list[subprocess.Popen] = []
    ensure_redis(settings, procs)
    require_database(settings)
    free_port(args.host, args.port)
    procs.append(spawn(web_command(host=args.host, port=args.port, workers=args.workers), env=child_env()))
    say(f"web server on http://{args.host}:{args.port}")
    return supervise(procs)


def cmd_worker(args) -> int:
    settings = setup_django()
    procs: list[subprocess.Popen] = []
    ensure_redis(settings, procs)
    require_database(settings)
    name = args.name or f"worker-{os.getpid()}@{socket.gethostname()}"
    procs.append(spawn(worker_command(queues=args.queues, concurrency=args.concurrency, name=name), env=child_env()))
    return supervise(procs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-platform",
        description="Run the self-hosted inference platform. Settings come from environment variables (see the README).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start everything in the foreground (Redis, migrations, web, worker)",
                        description="Start the whole platform on its embedded defaults; Ctrl-C stops it all.")
    up.add_argument("--host", default="127.0.0.1", help="address the web server listens on (default 127.0.0.1)")
    up.add_argument("--port", type=int, default=8000, help="web server port (default 8000)")
    up.add_argument("--concurrency", type=int, default=8, help="worker threads (default 8)")
    up.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for /readyz (default 180)")
    up.set_defaults(func=cmd_up)

    web = sub.add_parser("web", help="start the ASGI web server only", description="Start the ASGI web server (HTTP + WebSocket).")
    web.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    web.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    web.add_argument("--workers", type=int, default=1, help="web server processes (default 1)")
    web.set_defaults(func=cmd_web)

    worker = sub.add_parser("worker", help="start one Celery worker", description="Start one Celery worker process (thread pool, prefetch 1, late acks).")
    worker.add_argument("--queues", type=lambda s: [q for q in s.split(",") if q], default=DEFAULT_QUEUES,
                        help="comma-separated queues to consume (default: default,billing)")
    worker.add_argument("--concurrency", type=int, default=8, help="worker threads (default 8)")
    worker.add_argument("--name", default="", help="Celery node name (default worker-PID@HOST)")
    worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Abort as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
