"""compose.yaml, read as compose reads it with .env copied from .env.example and its password
changed, as its comment asks: every service finds the database and Redis compose runs, and every
command it runs is one the image knows."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from inference_platform.cli import build_parser
from tests.support import REPO_ROOT

APP_COMMAND = "inference-platform"
COMPOSE_ONLY = {"POSTGRES_PASSWORD", "GPU_TORCH_SPEC"}  # read by compose.yaml, not by the app


def dotenv(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {name: value for name, value in pairs}


def edited_env() -> dict[str, str]:
    """.env as an operator leaves it: the example with its own password."""
    return {**dotenv(REPO_ROOT / ".env.example"), "POSTGRES_PASSWORD": "ours4pg"}


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default} (the default may hold more) and ${NAME:?error}."""
    def one(match: re.Match) -> str:
        name, operator, rest = match.group(1), match.group(2), match.group(3)
        if variables.get(name):
            return variables[name]
        if operator == ":?":
            raise AssertionError(f"compose would stop: {name} is unset ({rest})")
        return interpolate(rest or "", variables)

    variable = re.compile(r"\$\{(\w+)(?:(:-|:\?)((?:[^{}]|\{[^{}]*\})*))?\}")
    while (found := variable.search(text)) is not None:
        text = text[:found.start()] + one(found) + text[found.end():]
    return text


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate((REPO_ROOT / "compose.yaml").read_text(), edited_env()))


def app_services(compose: dict) -> dict[str, dict]:
    return {name: service for name, service in compose["services"].items() if service.get("build")}


def service_env(service: dict) -> dict[str, str]:
    """What the container sees: the env file, then ``environment`` over it."""
    env = edited_env() if service.get("env_file") == ".env" else {}
    env.update({name: str(value) for name, value in (service.get("environment") or {}).items()})
    return env


def test_every_app_container_uses_composes_postgres_and_redis_with_the_password_postgres_gets(compose):
    password = compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert password == "ours4pg"
    for name, service in app_services(compose).items():
        env = service_env(service)
        database, broker = urlsplit(env.get("DATABASE_URL", "")), urlsplit(env.get("REDIS_URL", ""))
        # Without them a container would fall back to its own SQLite file and private Redis.
        assert (database.hostname, database.password) == ("postgres", password), name
        assert broker.hostname == "redis", name


def test_every_command_the_containers_run_is_one_the_command_line_accepts(compose):
    commands = [service["command"] for service in app_services(compose).values() if service.get("command")]
    ours = [command for command in commands if command[0] == APP_COMMAND]
    assert {command[1] for command in ours} >= {"web", "worker", "beat"}
    for command in ours:
        build_parser().parse_args(command[1:])  # exits (fails the test) on an unknown option


def test_the_migrate_step_runs_management_commands_that_exist(compose):
    from django.core.management import get_commands

    shell = compose["services"]["migrate"]["command"][-1]
    named = re.findall(r"manage\.py (\w+)", shell)
    assert named and set(named) <= set(get_commands())


def test_the_health_check_asks_a_url_the_web_server_serves(compose):
    from django.urls import resolve

    [url] = re.findall(r"http://127\.0\.0\.1:8000(/\w+)", " ".join(compose["services"]["web"]["healthcheck"]["test"]))
    assert resolve(url)


def test_every_setting_the_example_env_names_is_one_the_app_reads():
    read = set(re.findall(r'env_\w+\(\s*"([A-Z0-9_]+)"', (REPO_ROOT / "inference_platform" / "settings.py").read_text()))
    named = set(re.findall(r"^#?([A-Z][A-Z0-9_]+)=", (REPO_ROOT / ".env.example").read_text(), re.MULTILINE))
    assert named - COMPOSE_ONLY <= read, f"not read by the settings: {sorted(named - COMPOSE_ONLY - read)}"


def seconds_of(duration: str) -> float:
    """A compose duration (``stop_grace_period``): 90s, 11m, 1m30s, 1h."""
    found = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?", str(duration).strip())
    assert found and any(found.groups()), f"not a duration compose reads as meant here: {duration!r}"
    hours, minutes, secs = (int(part or 0) for part in found.groups())
    return hours * 3600 + minutes * 60 + secs


def test_an_inference_worker_is_given_longer_than_the_drain_timeout_to_stop(compose):
    """Its command waits up to FLEET_DRAIN_TIMEOUT for the running requests, and the web server
    streams their answers as long; docker's own default (10 s) would kill them first."""
    [default] = re.findall(r'FLEET_DRAIN_TIMEOUT = env_seconds\("FLEET_DRAIN_TIMEOUT", "(\d+)"',
                           (REPO_ROOT / "inference_platform" / "settings.py").read_text())
    inference = {}
    for name, service in app_services(compose).items():
        command = service.get("command") or []
        if command[:2] == [APP_COMMAND, "worker"]:
            args = build_parser().parse_args(command[1:])
            if (args.slots or 0) > 0 or args.deployments:
                inference[name] = service
    assert inference, "no inference worker in compose.yaml"
    inference["web"] = compose["services"]["web"]  # which streams those requests' answers meanwhile
    for name, service in inference.items():
        assert seconds_of(service.get("stop_grace_period", "10s")) > int(default), name


def test_the_migrate_step_waits_for_redis_as_seeding_wakes_the_placement_loop(compose):
    assert compose["services"]["migrate"]["depends_on"]["redis"] == {"condition": "service_healthy"}
