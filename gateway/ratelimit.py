"""Requests/min and tokens/min per API key and per organization, counted in Redis.

Every gateway process shares one count: a sliding window (a sorted set of timestamps) checked and
updated by one Lua script, so a key gets exactly its limit in any 60 seconds, never more and not
80% of it. Tokens are added when a request finishes, with its real counts.

The same script first checks the deployment's waiting requests (``workers.dispatch.waiting_key``:
those admitted that have not had their first token) against its queue limit: a full queue refuses
the request before any window counts it, an admitted one joins them in the same step (so a burst
never overshoots the limit), and the admission costs one round trip to Redis instead of two. A
request leaves them at its first token, its end, or when its gateway gives up on it
(``leave_queue``); one whose gateway died is let go after the longest wait there is.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from redis.maint_notifications import MaintNotificationsConfig
from django.conf import settings

WINDOW_MS = 60_000

# A token window is a sorted set of "<request id>:<tokens>" members scored by time, beside a
# running sum of their tokens (KEYS: the set, then its sum). Admission reads the sum and subtracts
# only the members that left the window, so its cost does not grow with the requests in it (summing
# every member cost 3.7 ms of Redis's one thread at 1,000 requests a minute). A sum that cannot be
# right is rebuilt from the members: one that is missing (evicted, or from before sums existed) or
# below zero; one whose set is gone counts nothing.
_TOKEN_WINDOW = """
local function tokens_of(member) return tonumber(string.match(member, ':(%d+)$')) or 0 end
local function ensure_sum(set, sum)
  if redis.call('EXISTS', set) == 0 then redis.call('DEL', sum); return end
  local current = tonumber(redis.call('GET', sum) or '-1')
  if current >= 0 then return end
  local used = 0
  for _, member in ipairs(redis.call('ZRANGE', set, 0, -1)) do used = used + tokens_of(member) end
  local ttl = redis.call('PTTL', set)
  if ttl > 0 then redis.call('SET', sum, used, 'PX', ttl) else redis.call('DEL', sum) end
end
"""

_ADMIT = _TOKEN_WINDOW + """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local queue_limit, waiting_ms = tonumber(ARGV[8]), tonumber(ARGV[10])
local function join()  -- KEYS[7]: the deployment's waiting requests
  if queue_limit < 0 then return end
  redis.call('ZADD', KEYS[7], now, ARGV[7])
  redis.call('PEXPIRE', KEYS[7], waiting_ms)
end
if queue_limit >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now - waiting_ms)
  local waiting = redis.call('ZCARD', KEYS[7])
  if waiting >= queue_limit then return {-1, waiting} end
end
if ARGV[9] == '0' then join(); return {1, 0} end  -- outside the windows (a batch's request)
local cutoff = now - window
local out = {1, 0}
for i = 1, 2 do  -- request windows: one member per request
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', cutoff)
  local count = redis.call('ZCARD', KEYS[i])
  local oldest = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
  local reset = 0
  if oldest[2] then reset = tonumber(oldest[2]) + window - now end
  if count >= tonumber(ARGV[2 + i]) then out[1] = 0; out[2] = math.max(out[2], reset) end
  table.insert(out, count); table.insert(out, reset)
end
for i = 3, 4 do  -- token windows (KEYS[5], KEYS[6]: their sums)
  local set, sum = KEYS[i], KEYS[i + 2]
  ensure_sum(set, sum)
  local gone = 0
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', set, '-inf', cutoff)) do gone = gone + tokens_of(member) end
  redis.call('ZREMRANGEBYSCORE', set, '-inf', cutoff)
  local used, reset = 0, 0
  local oldest = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  if oldest[2] then
    if gone > 0 and redis.call('EXISTS', sum) == 1 and redis.call('DECRBY', sum, gone) < 0 then
      ensure_sum(set, sum)  -- members added without the sum (a gateway of an older version)
    end
    used = math.max(0, tonumber(redis.call('GET', sum) or '0'))
    reset = tonumber(oldest[2]) + window - now
  else
    redis.call('DEL', sum)
  end
  if used >= tonumber(ARGV[2 + i]) then out[1] = 0; out[2] = math.max(out[2], reset) end
  table.insert(out, used); table.insert(out, reset)
end
if out[1] == 1 then
  for i = 1, 2 do
    redis.call('ZADD', KEYS[i], now, ARGV[7])
    redis.call('PEXPIRE', KEYS[i], window)
  end
  join()
end
return out
"""

# Add a finished request's tokens to its token windows (KEYS: set, sum, set, sum), once per request.
_RECORD = _TOKEN_WINDOW + """
local now, window, member, tokens = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
for i = 1, #KEYS, 2 do
  local set, sum = KEYS[i], KEYS[i + 1]
  ensure_sum(set, sum)
  if redis.call('ZADD', set, 'NX', now, member) == 1 then redis.call('INCRBY', sum, tokens) end
  redis.call('PEXPIRE', set, window)
  redis.call('PEXPIRE', sum, window)
end
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
class Window:
    """One of the four windows, as admission found it."""

    unit: str  # "requests" or "tokens"
    scope: str  # "key" or "organization"
    limit: int
    used: int
    reset_ms: int


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_ms: int
    headers: dict
    queue_full: bool = False  # refused for the deployment's queue (``headers`` empty), not a window
    exhausted: Window | None = None  # a refusal's window: the full one that frees up last


def _keys(key_id, org_id) -> list[str]:
    """The request windows, the token windows, the token windows' sums."""
    key, org = f"rl:key:{key_id}", f"rl:org:{org_id}"
    return [f"{key}:req", f"{org}:req", f"{key}:tok", f"{org}:tok", f"{key}:tok:sum", f"{org}:tok:sum"]


_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis]" = weakref.WeakKeyDictionary()
_record_scripts: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, object]" = weakref.WeakKeyDictionary()
_admit_script = None  # the Lua script registered on the process's blocking client (EVALSHA)
_sync_lock = threading.Lock()


def client() -> aioredis.Redis:
    """One connection pool per event loop (an asyncio pool cannot cross loops)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        # Maintenance notifications off: with them on (redis-py's default over TCP) its pool hands
        # out idle connections unchecked, and after a Redis restart each one's first call fails.
        _clients[loop] = aioredis.Redis.from_url(settings.REDIS_URL,
                                                 maint_notifications_config=MaintNotificationsConfig(enabled=False))
    return _clients[loop]


def _admission_script():
    """The admission script on a blocking client (a thread-safe pool) shared by admission threads."""
    global _admit_script
    with _sync_lock:
        if _admit_script is None:
            sync = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10, socket_connect_timeout=5)
            _admit_script = sync.register_script(_ADMIT)
        return _admit_script


def admit(*, key_id, org_id, request_id: str, limits: Limits | None = None, waiting: str | None = None,
          queue_limit: int | None = None, waiting_s: float = 600.0, windows: bool = True,
          now_ms: int | None = None) -> Decision:
    """Count this request if its deployment's waiting requests (the sorted set ``waiting``, of
    requests admitted less than ``waiting_s`` ago; None: not checked) are fewer than
    ``queue_limit`` and every window has room, and then add it to them; otherwise refuse it,
    counting nothing. ``windows=False``: the queue only (no window counts it, no headers).
    Blocking: it runs in the request's admission thread, with the database checks."""
    limits = limits or Limits.from_settings()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    checked = waiting is not None and queue_limit is not None
    out = _admission_script()(
        keys=[*_keys(key_id, org_id), waiting or "rl:unused"],
        args=[now, WINDOW_MS, limits.key_rpm, limits.org_rpm, limits.key_tpm, limits.org_tpm, request_id,
              queue_limit if checked else -1, 1 if windows else 0, int(waiting_s * 1000)],
    )
    if int(out[0]) == -1:
        return Decision(False, 1000, {}, queue_full=True)
    if not windows:
        return Decision(True, 0, {})
    allowed, retry_ms, key_req, key_req_reset, org_req, org_req_reset, key_tok, key_tok_reset, org_tok, org_tok_reset = (
        int(v) for v in out
    )
    counted = 1 if allowed else 0
    requests = _binding((limits.key_rpm, key_req + counted, key_req_reset if key_req else 0),
                        (limits.org_rpm, org_req + counted, org_req_reset if org_req else 0))
    tokens = _binding((limits.key_tpm, key_tok, key_tok_reset), (limits.org_tpm, org_tok, org_tok_reset))
    headers = {}
    for unit, (limit, remaining, reset) in (("requests", requests), ("tokens", tokens)):
        headers[f"x-ratelimit-limit-{unit}"] = str(limit)
        headers[f"x-ratelimit-remaining-{unit}"] = str(remaining)
        headers[f"x-ratelimit-reset-{unit}"] = duration(reset)
    if allowed:
        return Decision(True, retry_ms, headers)
    headers["retry-after"] = str(max(1, -(-retry_ms // 1000)))
    headers["retry-after-ms"] = str(retry_ms)
    windows = (Window("requests", "key", limits.key_rpm, key_req, key_req_reset),
               Window("requests", "organization", limits.org_rpm, org_req, org_req_reset),
               Window("tokens", "key", limits.key_tpm, key_tok, key_tok_reset),
               Window("tokens", "organization", limits.org_tpm, org_tok, org_tok_reset))
    full = [window for window in windows if window.used >= window.limit]
    return Decision(False, retry_ms, headers, exhausted=max(full, key=lambda w: w.reset_ms, default=None))


def _binding(key: tuple[int, int, int], org: tuple[int, int, int]) -> tuple[int, int, int]:
    """(limit, remaining, reset in ms) of the window that binds first, the key's or the
    organization's (each given as limit, used, reset): the headers describe one window, as
    OpenAI's do, not one's remaining with the other's reset."""
    (limit, used, reset), (org_limit, org_used, org_reset) = key, org
    if (org_limit - org_used, -org_reset) < (limit - used, -reset):
        limit, used, reset = org_limit, org_used, org_reset
    return limit, max(0, limit - used), reset


async def record_tokens(*, key_id, org_id, request_id: str, tokens: int, now_ms: int | None = None) -> None:
    """Add a finished request's tokens to both token windows (once, however often it is called)."""
    if tokens <= 0:
        return
    loop = asyncio.get_running_loop()
    if loop not in _record_scripts:
        _record_scripts[loop] = client().register_script(_RECORD)
    key_set, org_set, key_sum, org_sum = _keys(key_id, org_id)[2:]
    now = int(time.time() * 1000) if now_ms is None else now_ms
    await _record_scripts[loop](keys=[key_set, key_sum, org_set, org_sum],
                                args=[now, WINDOW_MS, f"{request_id}:{int(tokens)}", int(tokens)])


async def leave_queue(waiting: str, request_id: str) -> None:
    """The request had its first token, ended, or was given up on: it waits no more."""
    await client().zrem(waiting, request_id)


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
