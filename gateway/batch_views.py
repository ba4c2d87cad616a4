"""The Files and Batch APIs, as OpenAI's: upload a JSONL file of requests, start a batch of them,
follow it, read its output file. Plain synchronous views (uploads, listings): parse, call a
service or selector, render."""

from __future__ import annotations

import json

from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from . import batch_input, calls, pages, selectors, services
from .downloads import download
from .errors import ApiError, invalid, json_object
from .models import Batch, UploadedFile
from .views import read_json

BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}


def _api(view):
    """Authenticate the key (the ``inference`` scope), run the view, render ApiError as OpenAI does."""
    @csrf_exempt
    def wrapped(request, *args, **kwargs):
        try:
            caller = calls.authenticate_sync(request.headers.get("Authorization"))
            return view(request, caller, *args, **kwargs)
        except ApiError as exc:
            return exc.response()

    wrapped.__name__ = view.__name__
    return wrapped


def _method(request, *allowed: str) -> None:
    if request.method not in allowed:
        raise ApiError(405, f"Use {' or '.join(allowed)} for {request.path}.", code="method_not_allowed")


# ------------------------------------------------------------------------------------------ files

@_api
def files(request, caller):
    _method(request, "GET", "POST")
    if request.method == "GET":
        page = pages.parse(request.GET, default=10_000, maximum=10_000)
        purpose = request.GET.get("purpose")
        if purpose is not None and purpose not in UploadedFile.Purpose.values:
            raise invalid("purpose", f"purpose must be one of {', '.join(UploadedFile.Purpose.values)}")
        return JsonResponse(pages.page(selectors.files_of(organization_id=caller.org_id, purpose=purpose), page))
    length = request.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > settings.FILES_MAX_BYTES + 64 * 1024:
        raise ApiError(413, f"The file is larger than {settings.FILES_MAX_BYTES} bytes.", code="file_too_large")
    upload, purpose = request.FILES.get("file"), request.POST.get("purpose")
    if purpose != UploadedFile.Purpose.BATCH:
        raise invalid("purpose", f"purpose must be \"batch\" (the Batch API's input), not {json.dumps(purpose)[:60]}",
                      code="unsupported_value")
    if upload is None:
        raise invalid("file", "Send the file as multipart/form-data field \"file\".", code="missing_required_parameter")
    if upload.size > settings.FILES_MAX_BYTES:
        raise ApiError(413, f"The file is larger than {settings.FILES_MAX_BYTES} bytes.", code="file_too_large")
    content = upload.read()
    for _ in batch_input.objects(content, param="file"):  # JSON Lines, or a 400 naming the line
        pass
    name = upload.name if upload.name and upload.name.isprintable() else "upload.jsonl"
    created = services.create_file(organization_id=caller.org_id, purpose=purpose, filename=name, content=content)
    return JsonResponse(selectors.file_json(created))


def _no_file(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id[:80]}", param="id", code="file_not_found")


def _file(caller, file_id: str) -> UploadedFile:
    found = selectors.file_of(organization_id=caller.org_id, file_id=file_id)
    if found is None:
        raise _no_file(file_id)
    return found


@_api
def file_detail(request, caller, file_id: str):
    _method(request, "GET", "DELETE")
    found = _file(caller, file_id)
    if request.method == "DELETE":
        services.delete_file(organization_id=caller.org_id, file_id=found.pk)
        return JsonResponse({"id": found.pk, "object": "file", "deleted": True})
    return JsonResponse(selectors.file_json(found))


@_api
def file_content(request, caller, file_id: str):
    _method(request, "GET")
    found = selectors.file_of(organization_id=caller.org_id, file_id=file_id)
    if found is None:
        raise _no_file(file_id)
    return download(found)


# ---------------------------------------------------------------------------------------- batches

@_api
def batches(request, caller):
    _method(request, "GET", "POST")
    if request.method == "GET":
        listed = pages.page(selectors.batch_ids_of(organization_id=caller.org_id), pages.parse_newest_first(request.GET))
        found = {b.pk: b for b in selectors.batches_by_id(organization_id=caller.org_id,
                                                          ids=[item["id"] for item in listed["data"]])}
        return JsonResponse({**listed, "data": selectors.batches_json([found[item["id"]] for item in listed["data"]])})
    body = json_object(read_json(request))
    for name in body:
        if name not in BATCH_FIELDS:
            raise invalid(name, f"Unrecognized request argument supplied: {name}", code="unknown_parameter")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in batch_input.ENDPOINTS:
        raise invalid("endpoint", f"endpoint must be one of {', '.join(batch_input.ENDPOINTS)}",
                      code="unsupported_value" if endpoint is not None else "missing_required_parameter")
    if not isinstance(body.get("completion_window"), str) or body["completion_window"] not in services.BATCH_WINDOWS:
        raise invalid("completion_window", "completion_window must be \"24h\"")
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise invalid("input_file_id", "input_file_id must be the id of an uploaded file",
                      code="missing_required_parameter" if file_id is None else None)
    source = selectors.file_of(organization_id=caller.org_id, file_id=file_id)
    if source is None:
        raise ApiError(404, f"No batch input file {file_id[:80]}: upload one with purpose \"batch\".",
                       param="input_file_id", code="file_not_found")
    if source.purpose != UploadedFile.Purpose.BATCH:
        raise invalid("input_file_id", f"{file_id[:80]} is a file of purpose \"{source.purpose}\", not a batch's input: "
                                       "upload one with purpose \"batch\".", code="invalid_file_purpose")
    content = selectors.file_content(organization_id=caller.org_id, file_id=file_id)
    if content is None:  # deleted meanwhile
        raise ApiError(404, f"No batch input file {file_id[:80]}.", param="input_file_id", code="file_not_found")
    requests, model = batch_input.read_requests(content, endpoint=endpoint)
    _check_model(caller, model)
    batch = services.create_batch(organization_id=caller.org_id, api_key_id=caller.api_key.pk, endpoint=endpoint,
                                  input_file_id=file_id, requests=requests, model=model, metadata=metadata,
                                  completion_window=body["completion_window"])
    return JsonResponse(selectors.batch_json(batch))


def _metadata(value) -> dict:
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > 16
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       and k.isprintable() and "\x00" not in v for k, v in value.items())):
        raise invalid("metadata", "metadata must be an object of at most 16 string keys (64 characters) and "
                                  "string values (512 characters)")
    return value


def _check_model(caller, model: str) -> None:
    from models_catalog.errors import DeploymentNotFound
    from models_catalog.selectors import resolve_deployment

    try:
        if len(model) > 200 or not model.isprintable():
            raise DeploymentNotFound(model[:200])
        resolve_deployment(organization=caller.organization, name=model)
    except DeploymentNotFound as exc:
        raise ApiError(404, f"The batch's requests name a model you cannot call: {exc.message}",
                       param="input_file_id", code="model_not_found") from None


def _batch(caller, batch_id: str) -> Batch:
    found = selectors.batch_of(organization_id=caller.org_id, batch_id=batch_id)
    if found is None:
        raise ApiError(404, f"No such batch: {batch_id[:80]}", param="batch_id", code="batch_not_found")
    return found


@_api
def batch_detail(request, caller, batch_id: str):
    _method(request, "GET")
    return JsonResponse(selectors.batch_json(_batch(caller, batch_id)))


@_api
def batch_cancel(request, caller, batch_id: str):
    _method(request, "POST")
    batch = _batch(caller, batch_id)
    if batch.status in (Batch.Status.COMPLETED, Batch.Status.EXPIRED):
        raise invalid(None, f"The batch is {batch.status}: there is nothing to cancel.", code="batch_not_cancellable")
    return JsonResponse(selectors.batch_json(services.cancel_batch(batch=batch)))
