"""Parse and validate OpenAI-style request bodies into one neutral request for the workers.

Each endpoint keeps OpenAI's own spelling (chat's ``logprobs: true`` + ``top_logprobs``, the
legacy completions' integer ``logprobs``); both become the same ``sampling`` dict. Every
rejection names the offending parameter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from workers.dispatch import response_format_problem

from . import legacy_functions
from .errors import ApiError, invalid, json_object, json_type, text_only
from .tools import ToolTurns, parse_tools

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP = 4  # OpenAI allows up to four stop sequences
MAX_CHOICES = 128  # OpenAI's limit on n
MAX_MODEL_NAME = 200
TOP_P_MIN = 1e-6  # top_p 0 asks for the likeliest token alone; the sampler keeps at least one
COMMON_FIELDS = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "user",
    # Identifiers OpenAI takes for caching and abuse tracking: nothing to do with them here (the
    # prefix cache needs no key).
    "prompt_cache_key", "safety_identifier",
    # Common open-model extensions (vLLM, Together): accepted, passed to the sampler.
    "top_k", "min_p", "repetition_penalty",
}
# OpenAI's chat parameters this platform does nothing with: accepted at the values that ask for
# nothing (SDKs and frameworks send them so), any other value refused as unsupported (the client
# is not wrong, the platform lacks the feature), with what it does accept.
CHAT_NO_OPS = {
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "verbosity": ("medium",),  # the default
    "reasoning_effort": ("none",),  # the models here do not reason
    "audio": (),  # null only, as any of these
    "prediction": (),
    "web_search_options": (),
    # The prefix cache keeps what memory holds, however long it is asked to: either is best effort.
    "prompt_cache_retention": ("in_memory", "24h"),
}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "metadata",
                               "response_format", "tools", "tool_choice", "parallel_tool_calls"} | set(CHAT_NO_OPS)
# ``functions`` and ``function_call``, the deprecated form of tools, are read as tools first (see
# legacy_functions); sent as null, they are nothing.
CHAT_FIELDS |= set(legacy_functions.FIELDS)
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one request


@dataclass
class InferenceRequest:
    kind: str  # "chat" | "completion" | "embedding"
    model: str
    stream: bool
    include_usage: bool
    sampling: dict
    messages: list[dict] | None = None
    prompts: list[str | list[int]] | None = None  # a completion's: each is answered n times
    user: str | None = None
    n: int = 1  # answers to generate (OpenAI's ``n``)
    extra: dict = field(default_factory=dict)
    max_tokens_param: str = "max_tokens"  # the name the client gave the limit (for errors)

    def payload(self) -> dict:
        """The JSON-safe part the worker needs."""
        return {
            "kind": self.kind,
            "messages": self.messages,
            "prompts": self.prompts,
            "sampling": self.sampling,
            "n": self.n,
        }


def parse_chat(body: Any) -> InferenceRequest:
    body = json_object(body)
    legacy, answers_legacy = legacy_functions.uses_functions(body), legacy_functions.asks_functions(body)
    if legacy:
        body = legacy_functions.as_tools(body)
    _no_unknown(body, CHAT_FIELDS)
    _no_ops(body)
    try:
        messages = _messages(body.get("messages"))
        tool_fields = parse_tools(body)
    except ApiError as exc:
        raise legacy_functions.renamed(exc) if legacy else exc
    sampling = _sampling(body)
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise invalid("max_tokens", "max_tokens and max_completion_tokens cannot both be set; send "
                                        "max_completion_tokens alone", code="invalid_parameter_combination")
        sampling["max_tokens"] = _int(body, "max_completion_tokens", minimum=1)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("logprobs", "logprobs must be a boolean")
    top = body.get("top_logprobs")
    if top is not None:
        top = _int(body, "top_logprobs", minimum=0, maximum=20)
        if top and not logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    sampling["logprobs"] = bool(logprobs)
    sampling["top_logprobs"] = top or 0
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        sampling["response_format"] = response_format
    sampling.update(tool_fields)
    request = _request("chat", body, sampling, messages=messages)
    if answers_legacy and tool_fields:
        request.extra["legacy_functions"] = True  # the reply says function_call, as the client expects
    if body.get("max_completion_tokens") is not None:
        request.max_tokens_param = "max_completion_tokens"
    return request


def parse_completion(body: Any) -> InferenceRequest:
    body = json_object(body)
    _no_unknown(body, COMPLETION_FIELDS)
    prompts = _prompts(body.get("prompt"))
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo", "echo must be a boolean")
    # With echo, max_tokens may be 0: the prompt alone comes back, scored (evaluation harnesses).
    sampling = _sampling(body, least_max_tokens=0 if echo else 1)
    sampling.setdefault("max_tokens", 16)  # the legacy endpoint's documented default
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool):
            raise invalid("logprobs", "logprobs must be an integer between 0 and 5 on /v1/completions")
        count = _int(body, "logprobs", minimum=0, maximum=5)
        sampling["logprobs"], sampling["top_logprobs"] = True, count
    else:
        sampling["logprobs"], sampling["top_logprobs"] = False, 0
    if echo:
        sampling["echo"] = True
        if sampling["logprobs"] or sampling["max_tokens"] == 0:  # the prompt's own logprobs, scored
            sampling["prompt_logprobs"] = sampling["top_logprobs"]
    if body.get("suffix") is not None:
        raise invalid("suffix", f"suffix={json.dumps(body['suffix'])[:200]} is not supported by this platform; "
                                "leave it out", code="unsupported_value")
    request = _request("completion", body, sampling, prompts=prompts)
    if len(prompts) * request.n > MAX_CHOICES:
        raise invalid("n", f"{len(prompts)} prompts with n={request.n} ask for {len(prompts) * request.n} answers; "
                           f"at most {MAX_CHOICES} are allowed per request")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != request.n):
        # best_of > n would rank answers by likelihood and return the best: not done here.
        raise invalid("best_of", f"best_of={json.dumps(best_of)[:200]} is not supported by this platform; leave "
                                 "it out or send it equal to n", code="unsupported_value")
    return request


def parse_embedding(body: Any) -> InferenceRequest:
    """OpenAI's embeddings request: each ``input`` (a string, an array of token ids, or an array
    of either) is embedded by the deployment's model; ``dimensions`` keeps that many of each
    embedding's first values (normalized again), ``encoding_format`` writes them as numbers or
    as base64 of little-endian float32."""
    body = json_object(body)
    _no_unknown(body, EMBEDDING_FIELDS)
    inputs = _inputs(body.get("input"))
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise invalid("encoding_format", 'encoding_format must be "float" or "base64"')
    sampling = {"embed": True}
    if body.get("dimensions") is not None:
        sampling["dimensions"] = _int(body, "dimensions", minimum=1)
    request = _request("embedding", body, sampling, prompts=inputs)
    request.extra["encoding_format"] = encoding or "float"
    return request


def _inputs(value: Any) -> list[str | list[int]]:
    if value is None:
        raise invalid("input", "input is required", code="missing_required_parameter")
    if isinstance(value, str) or _is_tokens(value):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise invalid("input", f"at most {MAX_EMBEDDING_INPUTS} inputs are allowed per request")
        inputs = value
    else:
        raise invalid("input", "input must be a non-empty string, an array of token ids, or an array of either")
    for i, one in enumerate(inputs):
        where = "input" if len(inputs) == 1 and one is value else f"input[{i}]"
        if isinstance(one, str):
            if not one:
                raise invalid("input", f"{where} must not be empty")
            text_only(one, "input")
        elif not _is_tokens(one):
            raise invalid("input", f"{where} must be a non-empty string or a non-empty array of token ids")
    return inputs


def _request(kind: str, body: dict, sampling: dict, **content) -> InferenceRequest:
    model = body.get("model")
    if model is None or model == "" or isinstance(model, str) and not model.strip():
        raise invalid("model", "model is required: the name of a deployment (see GET /v1/models)",
                      code="missing_required_parameter" if model is None else None)
    if not isinstance(model, str):
        raise invalid("model", f"model must be a string (the name of a deployment, see GET /v1/models), "
                               f"not {json_type(model)}")
    if len(model) > MAX_MODEL_NAME or not model.isprintable():
        raise invalid("model", "model must be a deployment name (see GET /v1/models)")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", "stream must be a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise invalid("stream_options", "stream_options accepts only include_usage and include_obfuscation")
        include_usage = options.get("include_usage", False)
        for name in ("include_usage", "include_obfuscation"):  # no obfuscation is ever added
            if not isinstance(options.get(name, False), bool):
                raise invalid(f"stream_options.{name}", f"{name} must be a boolean")
    n = 1 if body.get("n") is None else _int(body, "n", minimum=1, maximum=MAX_CHOICES)
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise invalid(name, f"{name} must be a string")
    user = body.get("user")
    return InferenceRequest(kind=kind, model=model, stream=stream, include_usage=include_usage,
                            sampling=sampling, user=user, n=n, **content)


def _sampling(body: dict, *, least_max_tokens: int = 1) -> dict:
    sampling: dict = {}
    if body.get("max_tokens") is not None:
        sampling["max_tokens"] = _int(body, "max_tokens", minimum=least_max_tokens)
    for name, low, high, default in (
        ("temperature", 0.0, 2.0, 1.0),
        ("top_p", 0.0, 1.0, 1.0),
        ("presence_penalty", -2.0, 2.0, 0.0),
        ("frequency_penalty", -2.0, 2.0, 0.0),
        ("min_p", 0.0, 1.0, 0.0),
    ):
        sampling[name] = default if body.get(name) is None else _number(body, name, low, high)
    if sampling["top_p"] == 0:  # OpenAI takes 0 (only the likeliest token): the smallest nucleus
        sampling["top_p"] = TOP_P_MIN
    if body.get("repetition_penalty") is not None:
        value = _number(body, "repetition_penalty", 0.0, 10.0)
        if value == 0:
            raise invalid("repetition_penalty", "repetition_penalty must be greater than 0")
        sampling["repetition_penalty"] = value
    if body.get("top_k") is not None:
        sampling["top_k"] = _int(body, "top_k", minimum=-1)
    if body.get("seed") is not None:
        sampling["seed"] = _int(body, "seed", minimum=-(2**63), maximum=2**63 - 1)
    sampling["stop"] = _stop(body.get("stop"))
    if body.get("logit_bias") is not None:
        sampling["logit_bias"] = _logit_bias(body["logit_bias"])
    return sampling


def _messages(messages: Any) -> list[dict]:
    if messages is None:
        raise invalid("messages", "messages is required", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty array")
    clean, turns = [], ToolTurns()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                # An assistant's refusal, as OpenAI returns one, is what it said.
                field = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
                if field is None or not isinstance(part.get(field), str):
                    raise invalid(f"{where}.content[{j}]", "only text content parts are supported"
                                  + (" (and refusal parts in an assistant's)" if role == "assistant" else ""))
                parts.append(part[field])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"{where}.content must be a string or an array of text parts")
        text_only(content, f"{where}.content")
        clean.append({"role": "system" if role == "developer" else role, "content": content,
                      **turns.fields(message, where)})
    turns.end()
    return clean


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion: one (a string, or an array of token ids), or a batch of them."""
    if prompt is None:
        raise invalid("prompt", "prompt is required", code="missing_required_parameter")
    if isinstance(prompt, str) or _is_tokens(prompt):
        return [_one_prompt(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise invalid("prompt", f"at most {MAX_CHOICES} prompts are allowed per request")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise invalid("prompt", "prompt must be a non-empty string, an array of token ids, or an array of either")


def _one_prompt(prompt: str | list, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", f"{where} must not be empty")
        return text_only(prompt, "prompt")
    if not _is_tokens(prompt):
        raise invalid("prompt", f"{where} must be a non-empty string or a non-empty array of token ids")
    return prompt


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "stop must be a non-empty string or an array of non-empty strings")
    if len(stop) > MAX_STOP:
        raise invalid("stop", f"at most {MAX_STOP} stop sequences are allowed")
    for text in stop:
        text_only(text, "stop")
    return stop


def _logit_bias(bias: Any) -> dict[str, float]:
    if not isinstance(bias, dict):
        raise invalid("logit_bias", "logit_bias must be an object mapping token ids to numbers")
    clean = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):  # not "²"
            raise invalid("logit_bias", f"logit_bias key {key!r} is not a token id")
        if not _is_number(value):
            raise invalid("logit_bias", f"logit_bias for token {key} must be a number, not {json_type(value)}")
        if not -100 <= value <= 100:
            raise invalid("logit_bias", f"logit_bias for token {key} must be between -100 and 100")
        clean[key] = float(value)
    return clean


def _response_format(value: Any) -> dict | None:
    """OpenAI's response_format: None for text; a JSON one is checked whole here (its schema
    compiled as the worker will), so that a schema the engine cannot follow is a 400 at once."""
    if value is None:
        return None
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise invalid("response_format", 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                                         '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    extra = set(value) - ({"type", "json_schema"} if value["type"] == "json_schema" else {"type"})
    if extra:
        raise invalid("response_format", f"response_format of type {value['type']} takes no {sorted(extra)[0]!r}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format", "response_format.json_schema is required: an object with a name "
                                             "and a schema", code="missing_required_parameter" if spec is None else None)
        extra = set(spec) - {"name", "description", "schema", "strict"}
        if extra:
            raise invalid("response_format", f"response_format.json_schema takes no {sorted(extra)[0]!r}")
        name = spec.get("name")
        if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
            raise invalid("response_format", "response_format.json_schema.name must be 1 to 64 letters, digits, "
                                             "underscores or dashes")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise invalid("response_format", "response_format.json_schema.description must be a string")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise invalid("response_format", "response_format.json_schema.strict must be a boolean")
    problem = response_format_problem(value)
    if problem:
        raise invalid("response_format", f"response_format: {problem}")
    return value


def _no_ops(body: dict) -> None:
    for name, accepted in CHAT_NO_OPS.items():
        value = body.get(name)
        if value is not None and not any(value == ok and type(value) is type(ok) for ok in accepted):
            shown = "".join(f" or send {json.dumps(ok)}" for ok in accepted[:1]) + \
                "".join(f" or {json.dumps(ok)}" for ok in accepted[1:])
            raise invalid(name, f"{name}={json.dumps(value)[:200]} is not supported by this platform; "
                                f"leave it out{shown}", code="unsupported_value")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise invalid("metadata", "metadata must be an object of at most 16 string values")


def _no_unknown(body: dict, known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise invalid(name, f"Unrecognized request argument supplied: {name}", code="unknown_parameter")


def _int(body: dict, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = body.get(name)
    if not _is_int(value):
        raise invalid(name, f"{name} must be an integer")
    if minimum is not None and value < minimum:
        raise invalid(name, f"{name} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise invalid(name, f"{name} must be at most {maximum}")
    return value


def _number(body: dict, name: str, low: float, high: float) -> float:
    value = body.get(name)
    if not _is_number(value) or not math.isfinite(value):
        raise invalid(name, f"{name} must be a number")
    if not low <= value <= high:
        raise invalid(name, f"{name} must be between {low:g} and {high:g}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
