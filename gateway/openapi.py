"""``GET /v1/openapi.json``: the public API's OpenAPI 3 document.

The inference endpoints are async views outside DRF, so their request bodies are described here,
next to ``protocol.py`` whose limits they restate; the DRF endpoints (usage, billing, deployments)
come from drf-spectacular and are merged in.
"""

from __future__ import annotations

from django.http import JsonResponse
from django.views.decorators.http import require_GET

from .protocol import CHAT_NO_OPS
from .responses import INCLUDES

NUMBER = {"type": "number"}
ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
TOOL_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": TOOL_NAME, "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": ["boolean", "null"]}}}}}
TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": TOOL_NAME, "arguments": {"type": "string", "description": "JSON text"}}}}}
COMMON = {
    "model": {"type": "string", "description": "A deployment name from GET /v1/models."},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                       "additionalProperties": False},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {**NUMBER, "minimum": 0, "maximum": 2},
    "top_p": {**NUMBER, "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {**NUMBER, "minimum": 0, "maximum": 1},
    "repetition_penalty": {**NUMBER, "exclusiveMinimum": 0, "maximum": 10},
    "n": {"type": "integer", "minimum": 1, "maximum": 128, "default": 1,
          "description": "How many answers to generate; the prompt is billed once, the answers' tokens all. "
                         "With a seed, answer i samples with seed + i."},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}]},
    "seed": {"type": "integer"},
    "presence_penalty": {**NUMBER, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**NUMBER, "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "additionalProperties": {**NUMBER, "minimum": -100, "maximum": 100}},
    "user": {"type": "string"},
}
CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "additionalProperties": False,
    "properties": {
        **COMMON,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool",
                                                              "function"]},
                           "tool_calls": {"type": "array", "items": TOOL_CALL, "description": "assistant messages only"},
                           "function_call": {**TOOL_CALL["properties"]["function"], "deprecated": True,
                                             "description": "assistant messages only: the deprecated form of "
                                                            "tool_calls, answered by the function message after it"},
                           "tool_call_id": {"type": "string", "description": "tool messages: the call they answer"},
                           "content": {"oneOf": [
                               {"type": "string"},
                               {"type": "array", "items": {"oneOf": [
                                   {"type": "object", "required": ["type", "text"], "properties": {
                                       "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}},
                                   {"type": "object", "required": ["type", "refusal"], "description": "assistant messages only",
                                    "properties": {"type": {"type": "string", "enum": ["refusal"]},
                                                   "refusal": {"type": "string"}}}]}},
                               {"type": "null", "description": "assistant messages only"}]},
                           "name": {"type": "string"}}}},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "response_format": {"oneOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
             "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                            "json_schema": {"type": "object", "required": ["name"], "additionalProperties": False,
                                            "properties": {
                                                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                                "description": {"type": "string"},
                                                "schema": {"type": ["object", "boolean"]},
                                                "strict": {"type": ["boolean", "null"]}}}}}],
            "description": "json_object: the reply is a JSON object; json_schema: a JSON value of the schema "
                           "(type, properties, required, additionalProperties, items, minItems, maxItems, minLength, maxLength, "
                           "pattern, format, minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf, enum, "
                           "const, anyOf, oneOf, $ref, $defs). Decoding is constrained token by token."},
        "tools": {"type": "array", "maxItems": 128, "items": TOOL,
                  "description": "Functions the model may call; their parameters follow the response_format "
                                 "schema subset, and the calls' arguments are constrained to them."},
        "tool_choice": {"oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
        "parallel_tool_calls": {"type": "boolean", "default": True},
        "functions": {"type": "array", "maxItems": 128, "items": TOOL["properties"]["function"], "deprecated": True,
                      "description": "The deprecated form of tools (not beside them): one call at most, answered "
                                     "as message.function_call with finish_reason function_call."},
        "function_call": {"deprecated": True, "oneOf": [
            {"type": "string", "enum": ["none", "auto"]},
            {"type": "object", "required": ["name"], "additionalProperties": False,
             "properties": {"name": {"type": "string"}}}]},
        # Parameters for features this platform lacks, accepted at the values that ask for
        # nothing; any other value is a 400 unsupported_value.
        **{name: {"enum": list(accepted), "description": "Accepted, and ignored, at these values only."}
           for name, accepted in CHAT_NO_OPS.items()},
        "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string"},
                     "description": "Accepted and ignored."},
    },
}
PROMPT_TEXT = {"type": "string", "minLength": 1}
PROMPT_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "additionalProperties": False,
    "properties": {
        **COMMON,
        "prompt": {"oneOf": [PROMPT_TEXT, PROMPT_TOKENS,  # or a batch of either: n answers each, prompt by prompt
                             {"type": "array", "items": {"oneOf": [PROMPT_TEXT, PROMPT_TOKENS]}, "minItems": 1,
                              "maxItems": 128}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "max_tokens": {"type": "integer", "minimum": 0, "default": 16, "description": "0 only with echo."},
        "echo": {"type": "boolean", "description": "Write the prompt back before the answer; with logprobs, the "
                                                   "prompt tokens' logprobs too (the first has none). max_tokens "
                                                   "may then be 0: the prompt scored, nothing generated."},
        "suffix": {"type": "null"},
        "best_of": {"type": "integer", "minimum": 1, "maximum": 128,
                    "description": "Accepted only equal to n (every answer generated is returned)."},
    },
}
EMBEDDING_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "description": "A deployment name (see GET /v1/models)"},
        "input": {"oneOf": [PROMPT_TEXT, PROMPT_TOKENS,
                            {"type": "array", "items": {"oneOf": [PROMPT_TEXT, PROMPT_TOKENS]}, "minItems": 1,
                             "maxItems": 2048}],
                  "description": "Text or token ids, or up to 2048 of either: one embedding each, the model's "
                                 "final hidden state at the input's last token, L2-normalized."},
        "encoding_format": {"type": "string", "enum": ["float", "base64"], "default": "float",
                            "description": "Numbers, or base64 of little-endian float32."},
        "dimensions": {"type": "integer", "minimum": 1,
                       "description": "Keep this many leading values (at most the model's hidden size), normalized again."},
        "user": {"type": "string"},
    },
}
EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"type": "string", "enum": ["list"]}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "properties": {
        "object": {"type": "string", "enum": ["embedding"]}, "index": {"type": "integer"},
        "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
    "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                               "total_tokens": {"type": "integer"}}}}}
TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
RESPONSES_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "additionalProperties": False,
    "properties": {
        "model": COMMON["model"],
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"type": "object", "required": ["role", "content"], "properties": {
                "type": {"type": "string", "enum": ["message"]},
                "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}}},
            {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
                "type": {"type": "string", "enum": ["function_call"]}, "call_id": {"type": "string"},
                "name": TOOL_NAME, "arguments": {"type": "string"}}},
            {"type": "object", "required": ["type", "call_id", "output"], "properties": {
                "type": {"type": "string", "enum": ["function_call_output"]}, "call_id": {"type": "string"},
                "output": {"oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}}}]}}]},
        "instructions": {"type": "string"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        **{name: COMMON[name] for name in ("temperature", "top_p", "stream", "user")},
        "tools": {"type": "array", "maxItems": 128, "items": {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"type": "string", "enum": ["function"]}, "name": TOOL_NAME, "description": {"type": "string"},
            "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                  {"type": "object", "required": ["type", "name"], "properties": {
                                      "type": {"type": "string", "enum": ["function"]}, "name": TOOL_NAME}}]},
        "parallel_tool_calls": {"type": "boolean"},
        "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}, "name": {"type": "string"},
            "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
        "store": {"type": "boolean", "description": "Keep the response for GET /v1/responses/{id} and "
                                                   "previous_response_id (true by default)."},
        "previous_response_id": {"type": ["string", "null"], "description": "Continue a stored response: its conversation "
                                                                  "and output come before input."},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "truncation": {"type": "string", "enum": ["disabled", "auto"]},
        "stream_options": {"type": "object", "properties": {"include_obfuscation": {"type": "boolean"}}},
        "prompt_cache_key": {"type": "string"}, "safety_identifier": {"type": "string"},
        "service_tier": {"type": "string", "enum": ["auto", "default"]},
        # Accepted at the values that ask for nothing this platform lacks.
        "background": {"type": "boolean", "enum": [False]},
        "reasoning": {"type": "object", "additionalProperties": False, "properties": {
            "effort": {"enum": [None, "none"]}, "summary": {"type": "null"}, "generate_summary": {"type": "null"}}},
        "max_tool_calls": {"type": "null"},
        "prompt_cache_retention": {"type": "string", "enum": ["in_memory", "24h"]},
        "conversation": {"type": "null"}, "prompt": {"type": "null"}, "context_management": {"type": "null"},
        "include": {"type": "array", "items": {"type": "string", "enum": sorted(INCLUDES)},
                    "description": "message.output_text.logprobs: each output token's logprob; the others name "
                                   "parts this platform never produces"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20,
                         "description": "Alternatives per token; above 0 it asks for logprobs too"},
    },
}
USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
RESPONSE = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "system_fingerprint": {"type": "string"},
    "service_tier": {"type": "string", "description": "chat completions: always default"},
    "choices": {"type": "array", "items": {"type": "object"}}, "usage": USAGE}}
ERRORS = {str(code): {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
          for code, text in [(400, "Invalid request"), (401, "Bad API key"), (403, "Missing scope"),
                             (404, "Unknown model"), (413, "Body too large"), (429, "Rate limit or quota"),
                             (503, "No worker serves the model"), (504, "Timed out")]}


RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
PAGE_PARAMETERS = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
    {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"}},
    {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "The id of the item before the page"},
    {"name": "before", "in": "query", "schema": {"type": "string"}, "description": "The id of the item after the page"},
]


FILE = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["file"]}, "bytes": {"type": "integer"},
    "created_at": {"type": "integer"}, "filename": {"type": "string"},
    "purpose": {"type": "string", "enum": ["batch", "batch_output"]}, "status": {"type": "string"}}}
BATCH_REQUEST = {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
                 "additionalProperties": False, "properties": {
                     "input_file_id": {"type": "string"},
                     "endpoint": {"type": "string", "enum": ["/v1/chat/completions", "/v1/completions",
                                                             "/v1/embeddings"]},
                     "completion_window": {"type": "string", "enum": ["24h"]},
                     "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string"}},
                     "output_expires_after": {"type": "object", "description": "Accepted; output files are kept"}}}
BATCH = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["batch"]}, "endpoint": {"type": "string"},
    "status": {"type": "string", "enum": ["in_progress", "finalizing", "completed", "expired", "cancelling",
                                          "cancelled"]},
    "input_file_id": {"type": "string"}, "output_file_id": {"type": ["string", "null"]},
    "error_file_id": {"type": ["string", "null"]},
    "request_counts": {"type": "object", "properties": {name: {"type": "integer"}
                                                        for name in ("total", "completed", "failed")}}}}


def _ok(description: str, schema: dict, *errors: str) -> dict:
    return {"200": {"description": description, "content": {"application/json": {"schema": schema}}},
            **{code: ERRORS[code] for code in ("401", "403", *errors)}}


def _listed(item: dict) -> dict:
    return {"type": "object", "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": item},
                                             "has_more": {"type": "boolean"}}}


def _batch_paths() -> dict:
    """The Files API (a batch's input and output) and the Batch API."""
    secured = {"security": [{"bearer": []}]}
    file_id = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}
    batch_id = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/files": {
            "get": {"summary": "List your files", **secured, "parameters": [
                {"name": "purpose", "in": "query", "schema": {"type": "string"}}, *PAGE_PARAMETERS],
                "responses": _ok("A page of files", _listed(FILE), "400")},
            "post": {"summary": "Upload a batch's input: JSON Lines, one request per line", **secured,
                     "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                         "type": "object", "required": ["file", "purpose"], "properties": {
                             "file": {"type": "string", "format": "binary"},
                             "purpose": {"type": "string", "enum": ["batch"]}}}}}},
                     "responses": _ok("The file", FILE, "400", "413")}},
        "/v1/files/{file_id}": {
            "parameters": [file_id],
            "get": {"summary": "Retrieve a file", **secured, "responses": _ok("The file", FILE, "404")},
            "delete": {"summary": "Delete a file", **secured, "responses": _ok("Deleted", {"type": "object"}, "404")}},
        "/v1/files/{file_id}/content": {"get": {
            "summary": "A file's content", **secured, "parameters": [file_id],
            "responses": {"200": {"description": "The file's bytes", "content": {"application/jsonl": {
                "schema": {"type": "string"}}}}, **{code: ERRORS[code] for code in ("401", "403", "404")}}}},
        "/v1/batches": {
            "get": {"summary": "List your batches, newest first", **secured, "parameters": [
                p for p in PAGE_PARAMETERS if p["name"] in ("limit", "after")],
                "responses": _ok("A page of batches", _listed(BATCH), "400")},
            "post": {"summary": "Run an uploaded file's requests as a batch, at a discount", **secured,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": BATCH_REQUEST}}},
                     "responses": _ok("The batch", BATCH, "400", "404")}},
        "/v1/batches/{batch_id}": {"get": {"summary": "Retrieve a batch", **secured, "parameters": [batch_id],
                                           "responses": _ok("The batch", BATCH, "404")}},
        "/v1/batches/{batch_id}/cancel": {"post": {
            "summary": "Cancel a batch: what finished is kept", **secured, "parameters": [batch_id],
            "responses": _ok("The batch, cancelling", BATCH, "400", "404")}},
    }


def _inference_path(summary: str, schema: str) -> dict:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": "The completion, or an SSE stream of chunks ending with `data: [DONE]`",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **ERRORS},
    }}


def build() -> dict:
    from drf_spectacular.generators import SchemaGenerator

    document = SchemaGenerator(title="Inference Platform API", version="1.0.0").get_schema(request=None, public=True)
    document.setdefault("paths", {})
    document.setdefault("components", {}).setdefault("schemas", {})
    document["components"].setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
    document["components"]["schemas"].update(
        {"ChatCompletionRequest": CHAT_REQUEST, "CompletionRequest": COMPLETION_REQUEST, "ResponseRequest": RESPONSES_REQUEST,
         "EmbeddingRequest": EMBEDDING_REQUEST,
         "Completion": RESPONSE, "Error": ERROR}
    )
    model = {"type": "object", "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                              "created": {"type": "integer"}, "owned_by": {"type": "string"}}}
    document["paths"].update({
        "/v1/chat/completions": _inference_path("Create a chat completion", "ChatCompletionRequest"),
        "/v1/completions": _inference_path("Create a completion", "CompletionRequest"),
        "/v1/embeddings": {"post": {
            "summary": "Create embeddings",
            "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/EmbeddingRequest"}}}},
            "responses": {"200": {"description": "One embedding per input, in input order",
                                  "content": {"application/json": {"schema": EMBEDDINGS}}}, **ERRORS},
        }},
        "/v1/responses": {"post": {
            "summary": "Create a response (OpenAI's Responses API)",
            "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ResponseRequest"}}}},
            "responses": {"200": {"description": "The response object, or an SSE stream of typed events ending with "
                                                 "response.completed (or response.incomplete, or response.failed)",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **ERRORS},
        }},
        "/v1/responses/{response_id}": {
            "parameters": [RESPONSE_ID],
            "get": {"summary": "Retrieve a stored response", "security": [{"bearer": []}],
                    "responses": {"200": {"description": "The response object, as it was returned",
                                          "content": {"application/json": {"schema": {"type": "object"}}}},
                                  **{code: ERRORS[code] for code in ("400", "401", "403", "404")}}},
            "delete": {"summary": "Delete a stored response", "security": [{"bearer": []}],
                       "responses": {"200": {"description": "Deleted", "content": {"application/json": {"schema": {
                           "type": "object", "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                                            "deleted": {"type": "boolean"}}}}}},
                                     **{code: ERRORS[code] for code in ("401", "403", "404")}}},
        },
        "/v1/responses/{response_id}/input_items": {"get": {
            "summary": "List the input items a stored response answered (those of the responses it continued "
                       "included)",
            "security": [{"bearer": []}],
            "parameters": [RESPONSE_ID, *PAGE_PARAMETERS],
            "responses": {"200": {"description": "A page of items", "content": {"application/json": {"schema": {
                "type": "object", "properties": {
                    "object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object"}},
                    "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
                    "has_more": {"type": "boolean"}}}}}},
                          **{code: ERRORS[code] for code in ("400", "401", "403", "404")}}}},
        **_batch_paths(),
        "/v1/models": {"get": {"summary": "List the models (deployments) you can call", "security": [{"bearer": []}],
                               "responses": {"200": {"description": "Models", "content": {"application/json": {"schema": {
                                   "type": "object", "properties": {"data": {"type": "array", "items": model}}}}}},
                                   "401": ERRORS["401"]}}},
        "/v1/models/{name}": {"get": {"summary": "Retrieve a model", "security": [{"bearer": []}],
                                      "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                                      "responses": {"200": {"description": "The model", "content": {"application/json": {"schema": model}}},
                                                    "401": ERRORS["401"], "404": ERRORS["404"]}}},
    })
    return document


@require_GET
def schema(request):
    return JsonResponse(build(), json_dumps_params={"indent": 1})
