"""Run one request on this worker's engine and relay what it produces to the waiting gateway.

Events sent to the reply channel, in order:
    inference.accepted  a worker took the request and has to load the model first (only then:
                        one event fewer per request otherwise)
    inference.restarted only from a copy redelivered after its worker died, of a request whose
                        client does not stream: what the gateway holds of it is void
    inference.started   prompt_tokens, cached_prompt_tokens (the engine accepted the request)
    inference.delta     index (of the answer, with ``n``), text, token_ids, logprobs (per token:
                        token, bytes, logprob, top)
    inference.finished  finish_reason, usage, timings, error, and choices: each answer's index
                        and finish_reason (see ``workers.choices``)
or, instead of all of them, inference.error (status, message, param, code) when the request is
refused before it starts. Whatever happens after the engine accepted the request, a usage event
leaves for billing before this returns, i.e. before Celery acknowledges the task; and it leaves
before inference.finished, so a worker that dies between the two has still billed what the
client received (a request is never served for free, nor billed twice: billing keys it by id).
One narrow window remains: a death between the emit and the progress record's "billed" stage
looks like a death mid-stream, and recovery's "failed, free" event races the real one (billing
keeps whichever it records first).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone

from channels.exceptions import ChannelFull

from . import choices
from .cancellation import MARK_TTL_S
from .pulse import CHECK_EVERY_S, GatewayPulse
from .relay import Superseded

log = logging.getLogger(__name__)
STALL_TIMEOUT_S = 300.0  # an engine that yields nothing for this long has failed the request
STATUS_BY_FINISH = {"stop": "completed", "length": "completed", "abort": "cancelled", "error": "failed"}


def run(payload: dict, *, host, send, relay, cancels, worker_name: str = "", ticket=None) -> dict | None:
    """Serve one request: the start and the end go through ``send`` from this thread; the tokens
    go from the engine through ``relay`` (``workers.relay.StreamRelay``). Returns the usage event
    it emitted (None if the engine never took the request, or if another worker took it over:
    ``ticket``, see ``workers.agent``)."""
    from workers.engine import EngineError, InvalidRequestError, SamplingParams

    request_id, reply = payload["request_id"], payload["reply_channel"]
    if cancels.is_cancelled(request_id):
        return None  # the client gave up while the request was queued: nothing ran
    if (queued := _since_admission(payload)) > MARK_TTL_S:
        # Queued longer than any gateway waits for a worker (a deployment placed an hour late):
        # its client is gone, and a cancel mark may have expired since. Run, it would be billed.
        log.info("request %s waited %.0f s in its queue: its client is gone; not run", request_id, queued)
        return None
    pulse = GatewayPulse(payload["gateway_pulse"]) if payload.get("gateway_pulse") else None
    if pulse is not None and not _gateway_waits(pulse):
        # Its gateway died before a worker took it (a queue kept across a restart of the platform).
        log.info("request %s: its gateway is gone; not run", request_id)
        return None
    if host.spec(payload["deployment"]["name"]) is None:
        # The model must be loaded first: tell the gateway to wait for the load, not the queue.
        send_quietly(send, reply, {"type": "inference.accepted", "worker": worker_name})
    try:
        engine = host.engine_for(payload["deployment"])
    except Exception as exc:
        log.exception("deployment %s failed to load", payload["deployment"]["name"])
        send_quietly(send, reply, _error(503, f"the model failed to load: {exc}", code="model_load_failed"))
        return None
    n, prompts = payload.get("n", 1), _prompts(payload)
    if payload.get("kind") == "embedding":
        try:
            prompts = _embedding_inputs(engine, prompts, payload["sampling"])
        except InvalidRequestError as exc:
            send_quietly(send, reply, _refusal(exc, "embedding"))
            return None
    count = choices.sequences(payload)
    ids = choices.engine_ids(request_id, count)
    answers = choices.Choices([
        relay.stream(reply, _Delta(engine.tokenizer, payload["sampling"], index,
                                   prompts[index // n] if prompts is not None else None), ticket,
                     client_streams=payload.get("stream", True), request_id=request_id)
        for index in range(count)
    ], n=n)

    def submit(index: int, stream):
        params_of = choices.params_for(params, index % n)
        if prompts is None:
            return engine.submit_chat(payload["messages"], params_of, request_id=ids[index], listener=stream)
        try:
            return engine.submit(prompts[index // n], params_of, request_id=ids[index], listener=stream)
        except InvalidRequestError as exc:
            if len(prompts) == 1:
                raise
            raise InvalidRequestError(f"prompt[{index // n}]: {str(exc).removeprefix('prompt: ')}",
                                      param=exc.param) from None

    before_engine = _since_admission(payload)
    try:
        params = SamplingParams(**_engine_sampling(payload["sampling"]))
        answers.submit(submit)
    except InvalidRequestError as exc:
        send_quietly(send, reply, _refusal(exc, payload["kind"]))
        return None
    except EngineError as exc:  # stopped (an unload raced this request) or its loop died: retryable
        log.error("deployment %s could not take request %s: %s", payload["deployment"]["name"], request_id, exc)
        send_quietly(send, reply, _error(503, f"the model is not running on this worker ({exc}); retry",
                                         code="model_unavailable"))
        return None
    except Exception:  # a bug: answer now rather than leave the client waiting for a timeout
        log.exception("request %s could not be submitted", request_id)
        send_quietly(send, reply, _error(500, "the worker failed to start this request; it is logged",
                                         code="internal_error"))
        return None

    cancelled = threading.Event()  # a cancel came through Redis: the client's, or its gateway's

    def on_cancel():
        cancelled.set()
        answers.abort()

    cancels.watch(request_id, on_cancel)
    event, billing_tried = None, False
    try:
        if ticket is not None and ticket.superseded:  # handed on while this thread waited to run
            answers.abort()
            raise Superseded(request_id)
        _send_or_abort(send, reply, {"type": "inference.started", "prompt_tokens": answers.prompt_tokens,
                                     "fingerprint": getattr(engine, "fingerprint", None),
                                     "worker": worker_name}, answers)
        answers.open()
        outputs = answers.wait(STALL_TIMEOUT_S, report_every=progress_report_s(),
                               abandoned=pulse.gone if pulse is not None else None)
        gateway_gone = pulse is not None and pulse.abandoned
        if gateway_gone:
            log.info("request %s: its gateway is gone; cancelled", request_id)
        finished = {"type": "inference.finished", "finish_reason": choices.finish_reason(outputs),
                    "error": choices.error(outputs), "usage": choices.usage(outputs, n=n),
                    "timings": _timings_ms(choices.timings(outputs), before_engine),
                    "choices": [{"index": i, "finish_reason": out.finish_reason} for i, out in enumerate(outputs)]}
        try:
            billing_tried = True
            event = _bill(payload, answers, cancels, before_engine, cancelled=cancelled.is_set(),
                          gateway_gone_after=pulse.last_beat if gateway_gone else None, gateway_gone=gateway_gone)
        finally:  # the client gets its end even if billing failed (that error is raised on)
            send_quietly(send, reply, finished)
    except TimeoutError:
        answers.abort()
        send_quietly(send, reply, _error(504, "the engine produced nothing for too long", code="timeout"))
    except Superseded:  # the worker that took it over answers and bills it; the relay aborted this copy
        answers.abort()  # the answers its relay has not reached yet
        billing_tried = True
        cancels.unwatch(request_id)
    except Exception:  # the relay failed (a bug, or Redis down): answer now, not after a stall timeout
        if not billing_tried:
            log.exception("relaying request %s failed", request_id)
            send_quietly(send, reply, _error(500, "the worker failed while relaying this request; it is logged",
                                             code="internal_error"))
        raise
    finally:
        if not billing_tried:
            event = _bill(payload, answers, cancels, before_engine, cancelled=cancelled.is_set())
    return event


def _gateway_waits(pulse: GatewayPulse) -> bool:
    """Whether the gateway that sent a request still waits for it: its pulse is there, or comes back
    within the grace a Redis restart needs. A Redis that does not answer says yes (as before)."""
    deadline = time.monotonic() + pulse.grace_s + 2 * CHECK_EVERY_S
    while time.monotonic() < deadline:
        if pulse.gone():
            return False
        if pulse.last_beat is not None:
            return True
        time.sleep(CHECK_EVERY_S)
    return True


def progress_report_s() -> float:
    """How often a request that makes progress without output says so: often enough that the
    gateway's stall timer (GATEWAY_STALL_TIMEOUT) hears of it a few times before it fires."""
    from django.conf import settings

    return min(5.0, settings.GATEWAY_STALL_TIMEOUT / 4)


def _prompts(payload: dict) -> list | None:
    """A completion's prompts (None for chat); a payload queued by a gateway of before batches
    has one, as ``prompt``."""
    if payload["kind"] == "chat":
        return None
    return payload["prompts"] if "prompts" in payload else [payload["prompt"]]


class _Delta:
    """Engine outputs of answer ``index`` -> the delta events the gateway gets. The first of an
    answer that echoes its prompt carries the prompt: its text as the model's tokens read it
    (None for a text prompt not scored: the gateway has it), and its logprobs when scored."""

    def __init__(self, tokenizer, sampling: dict, index: int, prompt: str | list[int] | None) -> None:
        self.tokenizer, self.sampling, self.index, self.prompt = tokenizer, sampling, index, prompt
        self.echoing = bool(sampling.get("echo"))

    def __call__(self, out) -> dict:
        tokenizer, sampling = self.tokenizer, self.sampling
        entries = out.logprobs
        stop_entry = getattr(out, "stop_token_logprob", None)
        if stop_entry is not None and self.prompt is not None:  # a completion lists its stop token (OpenAI's do)
            entries = [*(entries or []), stop_entry]
        delta = {"type": "inference.delta", "index": self.index, "text": out.text, "token_ids": out.token_ids,
                 "logprobs": _logprobs(tokenizer, entries, sampling)}
        if out.finished:  # this answer's end, before its siblings' (the request's end waits for all)
            delta["finish_reason"] = out.finish_reason
        if getattr(out, "embedding", None) is not None:
            delta["embedding"] = _embedding(out.embedding, sampling.get("dimensions"))
        if self.echoing:
            self.echoing = False
            ids = out.prompt_token_ids or (self.prompt if isinstance(self.prompt, list) else None)
            delta["prompt"] = {
                "text": None if ids is None else tokenizer.decode(ids, skip_special_tokens=False),
                "logprobs": _prompt_logprobs(tokenizer, out, sampling) if out.prompt_logprobs is not None else None,
            }
        return delta


def _embedding(vector, dimensions: int | None) -> str:
    """An embedding as base64 of little-endian float32 (OpenAI's ``encoding_format: "base64"``,
    and a third of the JSON numbers' size on the way), cut to ``dimensions`` and normalized again."""
    import base64

    import numpy as np

    vector = np.asarray(vector, dtype=np.float32)
    if dimensions is not None and dimensions < vector.shape[0]:
        vector = vector[:dimensions]
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")


def _bill(payload: dict, answers: choices.Choices, cancels, before_engine: float = 0.0, *,
          cancelled: bool = False, gateway_gone: bool = False, gateway_gone_after: float | None = None) -> dict:
    """The request is over (or failed on the way): stop it and emit its usage event.
    ``gateway_gone``: its gateway died, alive last at ``gateway_gone_after`` (monotonic; None:
    never seen alive)."""
    cancels.unwatch(payload["request_id"])
    if not answers.ended:  # it failed on the way: stop generating for nobody
        answers.abort()
    event = _usage_event(payload, answers, before_engine)
    if gateway_gone or answers.lost:
        # Not its client's cancel: the platform's failure (its gateway died, or part of the answer,
        # maybe its end, never reached it), though the engine may have finished it.
        event["status"] = "failed"
    if not _delivered(payload, cancels, completed=event["status"] == "completed", cancelled=cancelled):
        event.update(completion_tokens=0, status="failed")  # the client got nothing: free
    elif event["status"] != "completed":
        # Cut short while streaming: what reached its gateway, which passed it on (before it died,
        # if it did), not what was generated after for nobody (a relay that failed, a dead gateway
        # noticed seconds late).
        if gateway_gone and gateway_gone_after is None:
            sent = 0  # its gateway was never seen alive: nothing reached its client
        else:
            sent = answers.tokens_sent(gateway_gone_after if gateway_gone else None)
        event["completion_tokens"] = min(event["completion_tokens"], sent)
    emit_usage(event)
    return event


def _delivered(payload: dict, cancels, *, completed: bool, cancelled: bool) -> bool:
    """Whether the client got the request's output, or gave it up itself: only then is the output
    billed. A streaming client got its tokens as they came. One that waits for the whole answer
    gets nothing when the gateway gave up on it (a void cancel: a timeout, Redis failing), even if
    the request ended as it should just then; nor when it ended any other way than as it should
    (stop or length) or by its own cancel: the relay failed, the gateway died, the worker stopped
    serving the model, the engine failed. It got an error it may retry, and must not pay twice."""
    from redis.exceptions import RedisError

    if payload.get("stream", True):
        return True
    try:
        void = cancels.is_void(payload["request_id"])  # read even when completed: the two may cross
    except RedisError as exc:  # Redis failing: the relay most likely failed too
        log.warning("could not tell whether %s was given up on (%s)", payload["request_id"], exc)
        return completed and not cancelled
    if void:
        return False
    return completed or cancelled


def emit_usage(event: dict) -> None:
    """Publish the usage event on the billing queue (validated; billing records it once per id)."""
    from billing.dispatch import emit_usage_event

    emit_usage_event(event)


EMBEDDING_MAX_TOKENS = 300_000  # OpenAI's limit on the inputs of one embeddings request, together


def _embedding_inputs(engine, inputs: list, sampling: dict) -> list[list[int]]:
    """An embeddings request's inputs as token ids (tokenized once, here), checked before anything
    runs: within EMBEDDING_MAX_TOKENS together (a request that size keeps a worker busy for long
    enough), and ``dimensions`` no more than the model's hidden size."""
    from workers.engine import InvalidRequestError

    dimensions = sampling.get("dimensions")
    if dimensions is not None and dimensions > (hidden_size := engine.config.hidden_size):
        raise InvalidRequestError(f"dimensions: this model's embeddings have {hidden_size} dimensions; "
                                  f"ask for {hidden_size} or fewer", param="dimensions")
    ids = [engine.tokenizer.encode(one, add_special_tokens=True) if isinstance(one, str) else one for one in inputs]
    total = sum(len(one) for one in ids)
    if total > EMBEDDING_MAX_TOKENS:
        raise InvalidRequestError(f"input: the inputs hold {total} tokens together; at most {EMBEDDING_MAX_TOKENS} "
                                  "are allowed per request: split them over several", param="input")
    return ids


def _engine_sampling(sampling: dict) -> dict:
    out = dict(sampling)
    out.pop("echo", None)  # the worker's to do (``_Delta``), not the engine's
    out.pop("dimensions", None)  # so is cutting an embedding
    if "logit_bias" in out:
        out["logit_bias"] = {int(k): v for k, v in out["logit_bias"].items()}
    return out


def _refusal(exc, kind: str) -> dict:
    message = str(exc)
    param = exc.param or "prompt"
    if param == "prompt" and kind != "completion":  # chat's prompt is its rendered messages, an embedding's its input
        param = "messages" if kind == "chat" else "input"
        message = message.replace("prompt", param, 1) if kind == "embedding" else message
    code = "context_length_exceeded" if "context" in message.lower() else "invalid_value"
    return _error(400, message, param=param, code=code)


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"type": "inference.error", "status": status, "message": message, "param": param, "code": code}


def _send_or_abort(send, reply: str, message: dict, handle) -> None:
    """A reply channel that overflows means the gateway is gone: stop generating for nobody."""
    try:
        send(reply, message)
    except ChannelFull:
        handle.abort()


def send_quietly(send, reply: str, message: dict) -> None:
    """Send, or log why not: the gateway may be gone, and what follows (billing) must still happen."""
    try:
        send(reply, message)
    except Exception as exc:
        log.warning("could not deliver %s to %s: %s", message["type"], reply, exc)


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as OpenAI's logprobs show it: its text and its raw bytes; one that is part of a
    character is written "bytes:\\xf0\\x9f" (its bytes still let the client rebuild the character)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, list(raw)


def _logprobs(tokenizer, entries, sampling: dict) -> list[dict] | None:
    if entries is None or not sampling.get("logprobs"):
        return None
    out = []
    for entry in entries:
        text, raw = _token(tokenizer, entry.token_id)
        top = [[alt_text, lp, alt_raw] for tid, lp in entry.top_logprobs for alt_text, alt_raw in [_token(tokenizer, tid)]]
        out.append({"token": text, "bytes": raw, "logprob": entry.logprob,
                    "top": top[: sampling.get("top_logprobs", 0)]})
    return out


def _prompt_logprobs(tokenizer, out, sampling: dict) -> list[dict] | None:
    """The prompt's entries, the first (which nothing comes before) with no logprob and no top."""
    if not sampling.get("logprobs"):
        return None
    text, raw = _token(tokenizer, out.prompt_token_ids[0])
    first = {"token": text, "bytes": raw, "logprob": None, "top": None}
    top = {**sampling, "top_logprobs": sampling.get("prompt_logprobs") or 0}
    return [first, *_logprobs(tokenizer, out.prompt_logprobs[1:], top)]


def _since_admission(payload: dict) -> float:
    """Seconds from the gateway's admission of the request to now, its engine's arrival: the task's
    queue, a model's load, and a first run whose worker died. 0 for a payload without the time
    (queued by an older gateway) or a clock behind the gateway's."""
    admitted_at = payload.get("admitted_at")
    return max(0.0, time.time() - admitted_at) if isinstance(admitted_at, (int, float)) else 0.0


def _timings_ms(timings, before_engine: float) -> dict:
    """The engine's timings, from the request's admission (``before_engine`` seconds before its
    arrival): what its client waited."""
    def ms(seconds, since_admission=True):
        if seconds is None:
            return None
        return round((seconds + (before_engine if since_admission else 0.0)) * 1000, 3)

    return {"queue_ms": ms(timings.queue_time), "ttft_ms": ms(timings.time_to_first_token),
            "tpot_ms": ms(timings.time_per_output_token, since_admission=False), "latency_ms": ms(timings.e2e_latency)}


def _batch_size(outputs: list) -> float | None:
    mean = outputs[0].timings.mean_batch_size
    return None if mean is None else round(mean, 3)


def _usage_event(payload: dict, answers: choices.Choices, before_engine: float = 0.0) -> dict:
    """What billing records, at the prices the gateway admitted the request at (a payload from a
    gateway older than those has none: billing then applies the catalog's). Without every final
    output (the worker failed mid-stream), the tokens counted are the prompt and what was
    generated so far, and the request is marked failed."""
    deployment = payload["deployment"]
    outputs = answers.lasts
    whole = all(out is not None and out.finished for out in outputs)
    if whole:
        usage, timings = choices.usage(outputs, n=answers.n), _timings_ms(choices.timings(outputs), before_engine)
        status = STATUS_BY_FINISH.get(choices.finish_reason(outputs), "failed")
    else:
        usage = choices.usage(outputs, n=answers.n, prompt_tokens=answers.prompt_tokens)
        timings, status = {"queue_ms": None, "ttft_ms": None, "latency_ms": None}, "failed"
    return {
        # Billing's idempotency key: a batch line's id, the same for each run of the line.
        "request_id": payload.get("billing_id") or payload["request_id"],
        "organization_id": payload["organization_id"],
        "api_key_id": payload.get("api_key_id"),
        "deployment_id": deployment["id"],
        "deployment": deployment["name"],
        "model": deployment["model"],
        **usage,
        "status": status,
        "queue_ms": timings.get("queue_ms"),
        "ttft_ms": timings.get("ttft_ms"),
        "latency_ms": timings.get("latency_ms"),
        "batch_size": _batch_size(outputs) if whole else None,
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "prices": payload.get("prices"),
        **({"endpoint": payload["endpoint"]} if payload.get("endpoint") else {}),
        # Billed under an id other than its own (a batch line's): an earlier run may have been
        # recorded under it, cut off, and this one's completion replaces that record.
        **({"rerun": True} if (payload.get("billing_id") or payload["request_id"]) != payload["request_id"] else {}),
    }
