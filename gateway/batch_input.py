"""A Batch API input file: JSON Lines, one request per line (``{"custom_id", "method": "POST",
"url", "body"}``), all for one endpoint and one model. Checked whole when a batch is created, so
that a malformed file is a 400 naming its line, not a batch that fails later."""

from __future__ import annotations

import json
from typing import Any, Iterator

from inference_platform import jsonbody

from .errors import invalid

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding"}
MAX_REQUESTS = 50_000
MAX_CUSTOM_ID = 512


def line_id(batch_id: str, line: int) -> str:
    """A batch request's id (0-based ``line``): its output line's, and the id billing records it
    under, so that the request run again after its runner died is charged once."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def objects(content: bytes, *, param: str) -> Iterator[tuple[int, dict]]:
    """Each non-blank line's JSON object, with its line number; 400 naming ``param`` and the line."""
    try:
        text = content.decode("utf-8-sig")  # a byte-order mark is no part of the first line
    except UnicodeDecodeError:
        raise invalid(param, "The file is not UTF-8 text: a batch file is JSON Lines.") from None
    # Lines end at \n (or \r\n) only: a JSON string may hold U+2028 and the like, which
    # str.splitlines would take for line ends.
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            value = jsonbody.loads(line)
        except ValueError:
            raise invalid(param, f"Line {number} is not valid JSON: a batch file has one JSON object per line.") \
                from None
        if not isinstance(value, dict):
            raise invalid(param, f"Line {number} is not a JSON object.")
        yield number, value


def read_requests(content: bytes, *, endpoint: str) -> tuple[list[dict], str]:
    """The requests of an input file (``[{"custom_id", "body"}]``) and the one model they name."""
    requests, seen, model = [], set(), None
    for number, line in objects(content, param="input_file_id"):
        custom_id, body = line.get("custom_id"), line.get("body")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            raise invalid("input_file_id", f"Line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID} "
                                           "characters.")
        if custom_id in seen:
            raise invalid("input_file_id", f"Line {number}: custom_id {_quoted(custom_id)} is used twice; each "
                                           "request needs its own.")
        seen.add(custom_id)
        if line.get("method") != "POST":
            raise invalid("input_file_id", f"Line {number}: method must be \"POST\".")
        if line.get("url") != endpoint:
            raise invalid("input_file_id", f"Line {number}: url is {_quoted(line.get('url'))}, but the batch's "
                                           f"endpoint is {endpoint}; a batch runs one endpoint.")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise invalid("input_file_id", f"Line {number}: body must be a JSON object naming a model.")
        if model is not None and body["model"] != model:
            raise invalid("input_file_id", f"Line {number}: body.model is {_quoted(body['model'])}, but line 1 "
                                           f"names {_quoted(model)}; a batch runs one model.")
        model = body["model"]
        requests.append({"custom_id": custom_id, "body": body})
        if len(requests) > MAX_REQUESTS:
            raise invalid("input_file_id", f"The file has more than {MAX_REQUESTS} requests, a batch's limit.")
    if not requests:
        raise invalid("input_file_id", "The input file has no requests.")
    return requests, model


def _quoted(value: Any) -> str:
    return json.dumps(value)[:80]
