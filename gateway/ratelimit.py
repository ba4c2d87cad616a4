"""Requests/min and tokens/min per API key and per organization, counted in Redis.

Every gateway process shares one count: a sliding window (a sorted set of timestamps) checked and
updated by one Lua script, so a key gets exactly its limit in any 60 seconds, never more and not
80% of it. Tokens are added when a request finishes, with its real counts.

The same script first checks the deployment's queue (the lists its waiting requests are on
against its queue limit): a full queue refuses the request before any window counts it, and the
admission costs one round trip to Redis instead of two.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from django.conf import settings

WINDOW_MS = 60_000

_ADMIT = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local queue_limit = tonumber(ARGV[8])
if queue_limit >= 0 then  -- KEYS[5..]: the deployment's queue lists
  local waiting = 0
  for i = 5, #KEYS do waiting = waiting + redis.call('LLEN', KEYS[i]) end
  if waiting >= queue_limit then return {-1, waiting} end
end
local out = {1, 0}
for i = 1, 4 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - window)
end
for i = 1, 2 do  -- request windows
  local count = redis.call('ZCARD', KEYS[i])
  local oldest = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
  local reset = 0
  if oldest[2] then reset = tonumber(oldest[2]) + window - now end
  if count >= tonumber(ARGV[2 + i]) then out[1] = 0; out[2] = math.max(out[2], reset) end
  table.insert(out, count); table.insert(out, reset)
end
for i = 3, 4 do  -- token windows: members are "<request id>:<tokens>"
  local used, reset = 0, 0
  local entries = redis.call('ZRANGE', KEYS[i], 0, -1, 'WITHSCORES')
  for j = 1, #entries, 2 do
    used = used + tonumber(string.match(entries[j], ':(%d+)$'))
    if reset == 0 then reset = tonumber(entries[j + 1]) + window - now end
  end
  if used >= tonumber(ARGV[2 + i]) then out[1] = 0; out[2] = math.max(out[2], reset) end
  table.insert(out, used); table.insert(out, reset)
end
if out[1] == 1 then
  for i = 1, 2 do
    redis.call('ZADD', KEYS[i], now, ARGV[7])
    redis.call('PEXPIRE', KEYS[i], window)
  end
end
return out
"""


@dataclass(frozen=True)
class Limits:
    key_rpm: int
    org_rpm: int
    key_tpm: int
    org_tpm: int

    @classmethod
    def from_settings(cls) -> "Limits":
        return cls(settings.RATE_LIMIT_KEY_RPM, settings.RATE_LIMIT_ORG_RPM,
                   settings.RATE_LIMIT_KEY_TPM, settings.RATE_LIMIT_ORG_TPM)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_ms: int
    headers: dict
    queue_full: bool = False  # refused for the deployment's queue (``headers`` empty), not a window


def _keys(key_id, org_id) -> list[str]:
    return [f"rl:key:{key_id}:req", f"rl:org:{org_id}:req", f"rl:key:{key_id}:tok", f"rl:org:{org_id}:tok"]


_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis]" = weakref.WeakKeyDictionary()
_admit_script = None  # the Lua script registered on the process's blocking client (EVALSHA)
_sync_lock = threading.Lock()


def client() -> aioredis.Redis:
    """One connection pool per event loop (an asyncio pool cannot cross loops)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = aioredis.Redis.from_url(settings.REDIS_URL)
    return _clients[loop]


def _admission_script():
    """The admission script on a blocking client (a thread-safe pool) shared by admission threads."""
    global _admit_script
    with _sync_lock:
        if _admit_script is None:
            sync = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10, socket_connect_timeout=5)
            _admit_script = sync.register_script(_ADMIT)
        return _admit_script


def admit(*, key_id, org_id, request_id: str, limits: Limits | None = None, queue_lists: list[str] = (),
          queue_limit: int | None = None) -> Decision:
    """Count this request if its deployment's queue is below ``queue_limit`` (the requests waiting
    on ``queue_lists``; None: not checked) and every window has room; otherwise refuse it,
    counting nothing. Blocking: it runs in the request's admission thread, with the database checks."""
    limits = limits or Limits.from_settings()
    now = int(time.time() * 1000)
    out = _admission_script()(
        keys=[*_keys(key_id, org_id), *queue_lists],
        args=[now, WINDOW_MS, limits.key_rpm, limits.org_rpm, limits.key_tpm, limits.org_tpm, request_id,
              -1 if queue_limit is None else queue_limit],
    )
    if int(out[0]) == -1:
        return Decision(False, 1000, {}, queue_full=True)
    allowed, retry_ms, key_req, key_req_reset, org_req, org_req_reset, key_tok, key_tok_reset, org_tok, org_tok_reset = (
        int(v) for v in out
    )
    counted = 1 if allowed else 0
    remaining_requests = min(limits.key_rpm - key_req, limits.org_rpm - org_req) - counted
    remaining_tokens = min(limits.key_tpm - key_tok, limits.org_tpm - org_tok)
    headers = {
        "x-ratelimit-limit-requests": str(min(limits.key_rpm, limits.org_rpm)),
        "x-ratelimit-remaining-requests": str(max(0, remaining_requests)),
        "x-ratelimit-reset-requests": duration(max(key_req_reset, org_req_reset) if (key_req or org_req) else 0),
        "x-ratelimit-limit-tokens": str(min(limits.key_tpm, limits.org_tpm)),
        "x-ratelimit-remaining-tokens": str(max(0, remaining_tokens)),
        "x-ratelimit-reset-tokens": duration(max(key_tok_reset, org_tok_reset)),
    }
    if not allowed:
        headers["retry-after"] = str(max(1, -(-retry_ms // 1000)))
        headers["retry-after-ms"] = str(retry_ms)
    return Decision(bool(allowed), retry_ms, headers)


async def record_tokens(*, key_id, org_id, request_id: str, tokens: int) -> None:
    """Add a finished request's tokens to both token windows."""
    if tokens <= 0:
        return
    now = int(time.time() * 1000)
    member = f"{request_id}:{int(tokens)}"
    pipe = client().pipeline(transaction=True)
    for name in _keys(key_id, org_id)[2:]:
        pipe.zadd(name, {member: now})
        pipe.pexpire(name, WINDOW_MS)
    await pipe.execute()


def duration(ms: int) -> str:
    """OpenAI's reset format: ``20ms``, ``1s``, ``6m0s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s"
