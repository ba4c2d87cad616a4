"""A private redis-server that a test can kill and start again, empty, as an operator's restart
does. On a free TCP port: over TCP, redis-py's asyncio pool hands out the connections that died
with the old server unchecked (over a unix socket it notices), and TCP is how deployments reach
Redis."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis

from inference_platform import processes
from tests.support import free_port, wait_until


class RestartableRedis:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [processes.redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.data_dir), "--daemonize", "no",
             "--logfile", str(self.data_dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_until(self.answers, timeout=15, interval=0.02, message=f"redis-server on port {self.port}")

    def kill(self) -> None:
        """Down, as with ``kill -9``: what it held is gone."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"redis-server exited (code {self.proc.returncode}); see {self.data_dir}")
        try:
            return redis.Redis(port=self.port, socket_timeout=1).ping()
        except redis.RedisError:
            return False


@pytest.fixture
def restartable_redis(tmp_path):
    server = RestartableRedis(tmp_path)
    server.start()
    yield server
    if server.proc.poll() is None:
        server.kill()
