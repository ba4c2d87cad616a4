"""The operator's command line, run as a user would: real processes, real signals."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.support import REPO_ROOT, free_port, wait_until

CLI = [sys.executable, "-m", "inference_platform.cli"]


def run_cli(*args, env_overrides: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY", "ALLOWED_HOSTS"}}
    env.update(env_overrides)
    return subprocess.run([*CLI, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def subcommands() -> list[str]:
    """Every subcommand the parser knows, so that a new one is covered by the tests below."""
    from inference_platform.cli import build_parser

    [action] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_the_subcommands_are_the_documented_ones():
    assert set(subcommands()) >= {"up", "web", "worker", "beat", "createkey"}


@pytest.mark.parametrize("command", [[], *([name] for name in subcommands())])
def test_every_command_has_help(command):
    result = subprocess.run([*CLI, *command, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" ".join(["usage: inference-platform", *command]))
    if not command:  # the top-level help lists every subcommand
        listed = re.findall(r"^    (\S+)", result.stdout, flags=re.MULTILINE)
        assert listed == subcommands(), result.stdout
    if command in (["up"], ["web"], ["worker"]):  # where they keep their data, and how to change it
        assert "DATA_DIR" in result.stdout and "DATABASE_URL" in result.stdout and "REDIS_URL" in result.stdout


def test_the_installed_console_script_runs():
    """The entry point pip installed (``inference-platform`` beside this Python), not ``python -m``."""
    script = shutil.which("inference-platform", path=str(Path(sys.executable).parent))
    assert script, f"no inference-platform script next to {sys.executable}"
    result = subprocess.run([script, "--help"], cwd="/", capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: inference-platform")
    assert all(name in result.stdout for name in subcommands())
    result = subprocess.run([script, "createkey", "--help"], cwd="/", capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--scopes" in result.stdout, result.stderr


HOW_TO_MAKE_A_KEY = "python -c 'import secrets; print(secrets.token_urlsafe(50))'"


@pytest.mark.parametrize("secret_key,says", [
    (None, "SECRET_KEY is not set"),  # unset: not "the placeholder", the development default it falls back to
    ("", "SECRET_KEY is not set"),
    ("   ", "SECRET_KEY is not set"),
    ("s3cr3t-but-short", "too short: 16 characters, needs 32 or more"),
    ("x" * 31, "too short: 31 characters"),
    ("my-own-change-me-key-that-is-long-enough-0123456789", "placeholder"),
])
def test_production_mode_refuses_a_bad_secret_key_saying_why(secret_key, says):
    overrides = {"DEBUG": "false", "ALLOWED_HOSTS": "example.com"}
    if secret_key is not None:
        overrides["SECRET_KEY"] = secret_key
    result = run_cli("web", env_overrides=overrides)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert says in result.stderr, result.stderr
    assert HOW_TO_MAKE_A_KEY in result.stderr, result.stderr
    if secret_key and secret_key.strip():  # a key that is there is never reported missing
        assert "not set" not in result.stderr, result.stderr


def test_the_secret_key_check_names_one_problem_and_accepts_a_good_key():
    from inference_platform.env import secret_key_problem

    placeholder = "dev-insecure-secret-key-change-me"
    assert secret_key_problem("x" * 32, placeholder) is None
    assert secret_key_problem("k" * 67, placeholder) is None
    assert secret_key_problem("", placeholder).startswith("SECRET_KEY is not set:")
    assert secret_key_problem(placeholder, placeholder).startswith("SECRET_KEY is the example's placeholder")
    short = secret_key_problem("abc", placeholder)
    assert short.startswith("SECRET_KEY is too short: 3 characters, needs 32 or more")
    assert "not set" not in short and HOW_TO_MAKE_A_KEY in short


def test_production_mode_refuses_empty_allowed_hosts():
    result = run_cli("web", env_overrides={"DEBUG": "false", "SECRET_KEY": "x" * 50})
    assert result.returncode == 2
    assert "ALLOWED_HOSTS" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["web", "up"])
@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7", "::", "example.com"])
def test_debug_mode_listens_on_this_machine_only(command, host, tmp_path):
    """Its error pages show tracebacks and settings: refused before anything starts."""
    result = run_cli(command, "--host", host, "--port", str(free_port()), env_overrides={"DATA_DIR": str(tmp_path)})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "DEBUG=false" in result.stderr and host in result.stderr


def test_loopback_addresses_are_this_machine():
    from types import SimpleNamespace

    from inference_platform.cli import refuse_debug_off_loopback

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        refuse_debug_off_loopback(SimpleNamespace(DEBUG=True), host)
    refuse_debug_off_loopback(SimpleNamespace(DEBUG=False), "0.0.0.0")


@pytest.mark.parametrize("name,value,says", [
    ("GATEWAY_QUEUE_TIMEOUT", "abc", "a number of seconds"),
    ("READYZ_WORKER_TIMEOUT", "-1", "at least"),
    ("RATE_LIMIT_KEY_RPM", "0", "at least 1"),
    ("GATEWAY_MAX_BODY_BYTES", "-10", "at least"),
    ("LOG_LEVEL", "loud", "LOG_LEVEL must be"),
    ("TOPUP_MIN", "5E+1", "a decimal amount in USD"),  # the page would show it, and parse it, as written
    ("BILLING_SIGNUP_CREDIT", "-5", "a decimal amount in USD"),
    ("REDIS_URL", "http://user:secret@x", "must start with redis://"),
    ("REDIS_URL", "redis://user:secret@[::1", "an address that cannot be read"),
])
def test_a_bad_setting_stops_with_a_line_naming_it(name, value, says):
    result = run_cli("web", "--port", str(free_port()), env_overrides={name: value})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert name in result.stderr and says in result.stderr and "secret" not in result.stderr


def test_a_django_log_line_is_written_once_with_its_time_in_debug_mode():
    code = ("import django, logging, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'inference_platform.settings'; "
            "django.setup(); logging.getLogger('django.request').warning('Bad Request: /v1/embeddings')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**os.environ, "DEBUG": "true"},
                            capture_output=True, text=True, timeout=60)
    lines = [line for line in result.stderr.splitlines() if "Bad Request" in line]
    assert len(lines) == 1 and " WARNING django.request: Bad Request" in lines[0], result.stderr


def test_a_lowercase_log_level_is_fine_and_a_bad_port_is_refused_by_the_parser():
    from inference_platform.cli import local_url

    code = ("import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'inference_platform.settings'; "
            "django.setup(); from django.conf import settings; print(settings.LOG_LEVEL)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**os.environ, "LOG_LEVEL": "debug"},
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "DEBUG", result.stderr
    assert run_cli("web", "--port", "99999", env_overrides={}).returncode == 2
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"  # polled by up: a wildcard is no address
    assert local_url("::", 8000) == "http://[::1]:8000"


def test_sqlite_urls_read_as_sqlalchemy_reads_them():
    from pathlib import Path

    from inference_platform.env import database_from_url

    assert database_from_url("sqlite:///here.db", data_dir=Path("/tmp"))["NAME"] == "here.db"  # relative
    assert database_from_url("sqlite:////srv/x.db", data_dir=Path("/tmp"))["NAME"] == "/srv/x.db"


def test_database_url_parameters_reach_the_driver():
    from pathlib import Path

    from inference_platform.env import database_from_url

    db = database_from_url("postgresql://u:p@db.internal:6543/app?sslmode=verify-full&sslrootcert=/ca.pem",
                           data_dir=Path("/tmp"))
    assert db["PORT"] == "6543" and db["OPTIONS"]["sslmode"] == "verify-full"
    assert db["OPTIONS"]["sslrootcert"] == "/ca.pem" and db["OPTIONS"]["connect_timeout"] == 5


def test_a_database_that_is_down_gives_one_clear_line_without_the_password():
    port = free_port()
    result = run_cli(
        "web", "--port", str(free_port()),
        env_overrides={"DATABASE_URL": f"postgresql://bob:hunter2@127.0.0.1:{port}/nowhere"},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "database" in lines[0] and f"127.0.0.1:{port}" in lines[0]
    assert "hunter2" not in result.stderr


def test_a_redis_that_is_down_gives_one_clear_line_without_the_password():
    port = free_port()
    result = run_cli("worker", env_overrides={"REDIS_URL": f"redis://:hunter2@127.0.0.1:{port}/0"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Redis" in lines[0] and f"127.0.0.1:{port}" in lines[0]
    assert "hunter2" not in result.stderr


def run_manage(*args, env_overrides: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_overrides}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_manage_py_with_the_database_down_gives_one_clear_line_without_the_password():
    port = free_port()
    result = run_manage("migrate", env_overrides={"DATABASE_URL": f"postgresql://bob:hunter2@127.0.0.1:{port}/nowhere"})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "database" in lines[0] and f"postgresql://bob:***@127.0.0.1:{port}/nowhere" in lines[0]


def test_manage_py_with_redis_down_gives_one_clear_line_without_the_password():
    port = free_port()
    result = run_manage("shell", "-c", "from workers import fleet; fleet.client().ping()",
                        env_overrides={"REDIS_URL": f"redis://:hunter2@127.0.0.1:{port}/0"})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Redis" in lines[0] and f"127.0.0.1:{port}" in lines[0]


def test_manage_py_still_shows_a_database_error_that_is_not_a_connection_down(django_db_setup):
    """The (test) database answers: an OperationalError of the command's own (a statement timeout)
    keeps its traceback and is not blamed on the connection."""
    from tests.conftest import test_database_url

    code = ("from django.db import connection; "
            "connection.cursor().execute('SET statement_timeout = 1; SELECT pg_sleep(5)')")
    result = run_manage("shell", "-c", code, env_overrides={"DATABASE_URL": test_database_url()})
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "OperationalError" in result.stderr
    assert "statement timeout" in result.stderr and "cannot reach" not in result.stderr


def test_the_stdlib_platform_module_is_not_shadowed():
    result = subprocess.run(
        [sys.executable, "-c", "import uuid, platform; print(platform.system())"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Linux"


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_up(tmp_path, *extra: str) -> tuple[subprocess.Popen, int, Path]:
    """``inference-platform up`` on the embedded defaults, in a process group of its own (as in a
    terminal), once it says it is ready: (process, web port, its output's file)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env["DATA_DIR"] = str(tmp_path)
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*CLI, "up", "--port", str(port), "--concurrency", "2", *extra],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "Ready." in log.read_text() or proc.poll() is not None, timeout=180, interval=0.5,
                   message="`up` to say it is ready")
    except BaseException:
        proc.kill()
        raise
    return proc, port, log


def test_up_starts_everything_on_embedded_defaults_and_ctrl_c_leaves_no_process(tmp_path):
    """No DATABASE_URL, no REDIS_URL: SQLite and a private Redis; SIGINT stops every child, the
    web server's worker processes included."""
    proc, port, log = start_up(tmp_path, "--web-workers", "2")
    try:
        assert ready(f"http://127.0.0.1:{port}/readyz"), log.read_text()
        # "Ready" waits for the model: the first request does not pay for its load.
        assert "deployment smollm2-135m-instruct ready in" in (tmp_path / "logs" / "worker.log").read_text()
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(child.cmdline()) for child in children)
        assert "redis-server" in names and "celery" in names and "uvicorn" in names
        celery = [child for child in children if "celery" in " ".join(child.cmdline())]
        assert len(celery) >= 4  # inference, billing and batch workers, beat: the billing one's emails link here
        assert {child.environ().get("OWN_SITE_URL") for child in celery} == {f"http://127.0.0.1:{port}"}
        [web] = [child for child in children if "uvicorn" in " ".join(child.cmdline())]
        assert sum("spawn_main" in " ".join(c.cmdline()) for c in web.children()) == 2  # and a resource tracker
        assert (tmp_path / "db.sqlite3").exists() and (tmp_path / "redis.sock").exists()

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        proc.wait(timeout=60)
        output = log.read_text()
        assert proc.returncode == 0, output
        assert "Dashboard:" in output and "Log in as:" in output
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert alive == [], f"left behind: {[p.cmdline() for p in alive]}"
        for name in ("worker.log", "billing.log", "batches.log", "beat.log"):  # Redis outlived them: a clean shutdown
            assert "Traceback" not in (tmp_path / "logs" / name).read_text(), name
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_killed_outright_leaves_no_process(tmp_path):
    """SIGKILL gives ``up`` no chance to stop anything: its children must die with it (and the
    web server's own worker processes with theirs)."""
    proc, port, log = start_up(tmp_path)
    try:
        assert ready(f"http://127.0.0.1:{port}/readyz"), log.read_text()
        everything = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(p.cmdline()) for p in everything)
        proc.kill()
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(everything, timeout=30)
        assert alive == [], f"left behind: {[p.cmdline() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.django_db
def test_up_does_not_wait_for_a_model_whose_load_failed():
    """A model that cannot load is not waited for (nor does it stop the platform): its reason comes
    back at once, to be said, and a timeout names only the deployments still loading."""
    from django.utils import timezone

    from inference_platform.cli import Abort, wait_loaded
    from workers.services import record_event

    since = timezone.now()
    worker = "worker@nowhere-test"  # answers no remote control: only the failure can end the wait
    record_event(kind="failed", deployment=None, deployment_name="smol", worker=worker, message="weights are corrupt")
    assert wait_loaded(["smol"], worker, [], deadline_s=60, since=since) == {"smol": "weights are corrupt"}
    with pytest.raises(Abort, match="did not load other within 1s"):
        wait_loaded(["smol", "other"], worker, [], deadline_s=1, since=since)
    with pytest.raises(Abort, match="did not load smol within 1s"):  # an older failure is not this start's
        wait_loaded(["smol"], worker, [], deadline_s=1, since=timezone.now())


@pytest.mark.django_db
def test_up_serves_the_public_deployments_but_those_stopped_and_tries_a_failed_one_again():
    from inference_platform.cli import served_deployments
    from models_catalog.models import CatalogModel, Deployment
    from models_catalog.services import create_deployment, seed_catalog, set_deployment_status

    seed_catalog()
    Deployment.objects.exclude(is_public=True).delete()
    model = CatalogModel.objects.get(slug="smollm2-135m-instruct")
    stopped, failed = (create_deployment(organization=None, model=model, name=name, is_public=True)
                       for name in ("t-stopped", "t-failed"))
    set_deployment_status(deployment=stopped, status="stopped", reason="the operator stopped it")
    set_deployment_status(deployment=failed, status="failed", reason="weights not found")
    served = served_deployments()
    assert "t-failed" in served and "t-stopped" not in served and "smollm2-135m-instruct" in served
    failed.refresh_from_db()
    assert failed.status == "pending" and "trying again" in failed.status_reason


def test_production_hosts_keep_the_loopback_names_for_the_local_health_checks():
    """`up` and compose's health check call /readyz on 127.0.0.1, whatever ALLOWED_HOSTS names."""
    code = ("import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'inference_platform.settings'; "
            "django.setup(); from django.conf import settings; print(','.join(settings.ALLOWED_HOSTS))")
    env = {**os.environ, "DEBUG": "false", "SECRET_KEY": "x" * 50, "ALLOWED_HOSTS": "platform.example.com"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip().split(",") == ["platform.example.com", "localhost", "127.0.0.1", "[::1]"], \
        result.stderr


def test_a_second_up_on_the_same_data_folder_is_refused_in_one_line(tmp_path):
    """The lock is held while the first `up` lives (here: this process holds it)."""
    from inference_platform.cli import lock_data_dir

    held = lock_data_dir(tmp_path)
    try:
        result = run_cli("up", "--port", str(free_port()), env_overrides={"DATA_DIR": str(tmp_path)})
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert f"another `inference-platform up` (pid {os.getpid()}) is running on {tmp_path}" in result.stderr
    finally:
        held.close()
    lock_data_dir(tmp_path).close()  # free again once the holder is gone


def test_a_data_folder_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = run_cli("createkey", env_overrides={"DATA_DIR": str(tmp_path / "a-file" / "data")})
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "cannot create the data folder" in result.stderr and "DATA_DIR" in result.stderr


def test_a_new_data_folder_is_its_users_only(tmp_path):
    """It will hold the SQLite database (password hashes, sessions), the logs and the keys."""
    run_cli("createkey", env_overrides={"DATA_DIR": str(tmp_path / "fresh")})
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700


def test_what_is_written_in_a_data_folder_open_to_others_is_its_users_only_and_the_folder_is_said(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    result = run_cli("createkey", env_overrides={"DATA_DIR": str(shared), "DATABASE_URL": "", "REDIS_URL": ""})
    assert "other users of this machine may enter the data folder" in result.stderr and "chmod 700" in result.stderr
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "DEBUG", "SECRET_KEY", "ALLOWED_HOSTS"}}
    subprocess.run([sys.executable, "manage.py", "shell", "-c",
                    "from django.db import connection; connection.ensure_connection()"],
                   cwd=REPO_ROOT, env={**env, "DATA_DIR": str(shared)}, check=True, timeout=60)
    assert (shared / "db.sqlite3").stat().st_mode & 0o777 == 0o600


def test_up_names_the_part_that_stopped():
    from inference_platform.processes import describe, spawn

    named = spawn([sys.executable, "-c", "pass"], role="the billing worker")
    unnamed = spawn([sys.executable, "-c", "pass"])
    for proc in (named, unnamed):
        proc.wait()
    assert describe(named) == "the billing worker"
    assert describe(unnamed) == f"{sys.executable} -c pass"


@pytest.mark.parametrize("args", [["up", "--slots", "-1"], ["up", "--web-workers", "0"], ["up", "--ready-timeout", "-1"],
                                  ["up", "--ready-timeout", "inf"], ["web", "--workers", "-1"],
                                  ["worker", "--concurrency", "-3"], ["worker", "--slots", "x"]])
def test_out_of_range_options_are_refused_by_the_parser(args):
    result = run_cli(*args, env_overrides={})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument {args[1]}" in result.stderr


@pytest.mark.parametrize("name, value", [("WORKER_SLOTS", "-3"), ("FLEET_MISSED_HEARTBEATS", "-1"),
                                         ("FLEET_SCALE_UP_QUEUE_DEPTH", "-4"), ("CELERY_UNACKED_RESTORE_INTERVAL", "-5"),
                                         ("GATEWAY_QUEUE_TIMEOUT", "inf")])
def test_out_of_range_fleet_settings_are_named_at_start(name, value):
    result = run_cli("createkey", env_overrides={name: value})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert name in result.stderr


@pytest.mark.parametrize("command", [["createkey"], ["import-model", "some.gguf"]])
def test_a_command_on_a_data_folder_up_never_made_says_so_and_leaves_no_empty_database(tmp_path, command):
    fresh = tmp_path / "fresh"
    result = run_cli(*command, env_overrides={"DATA_DIR": str(fresh), "DATABASE_URL": "", "REDIS_URL": ""})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "run `inference-platform up` first" in result.stderr, result.stderr
    assert not (fresh / "db.sqlite3").exists()


def test_a_production_start_says_what_it_leaves_to_the_development_defaults(settings):
    from inference_platform.cli import production_gaps

    settings.DEBUG, settings.SITE_URL, settings.HTTPS = False, "", False
    settings.EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
    gaps = " ".join(production_gaps(settings))
    assert "EMAIL_BACKEND" in gaps and "SITE_URL" in gaps and "HTTPS" in gaps
    settings.SITE_URL, settings.HTTPS = "https://llm.example.com", True
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    assert production_gaps(settings) == []
    settings.DEBUG = True
    settings.EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
    assert production_gaps(settings) == []  # the development defaults are what development wants
