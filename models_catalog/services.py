"""Every write of the catalog app. Keyword-only arguments."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable

from django.conf import settings as django_settings
from django.db import DataError, IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from accounts.models import Organization
from inference_platform import read_cache

from . import signals
from .errors import DeploymentNotFound, InvalidCatalogModel, InvalidDeployment, ModelImportError
from .models import DEPLOYMENT_NAME_PATTERN, PRICE_FIELD, CatalogModel, Deployment
from .selectors import deployment_name_taken
from .weights import inspect_weights, missing_weights_message, models_root, path_under_models_root

# Settings a caller may give a deployment, with the bounds the service enforces (the database
# enforces the lower bounds and max_replicas >= min_replicas itself).
INT_SETTINGS = {
    "batch_window_ms": (0, 10_000),
    "max_batch_size": (1, 1024),
    "queue_limit": (1, 100_000),
    "min_replicas": (0, 64),
    "max_replicas": (1, 64),
    "scale_to_zero_seconds": (0, 7 * 24 * 3600),
}
CHOICE_SETTINGS = {
    "kind": Deployment.Kind.values,
    "dtype": Deployment.Dtype.values,
    "quantization": Deployment.Quantization.values,
}
BOOL_SETTINGS = {"is_public"}
SETTINGS = set(INT_SETTINGS) | set(CHOICE_SETTINGS) | BOOL_SETTINGS
# The settings a worker builds the deployment's engine with (``workers.dispatch.engine_spec``):
# the placement loop replaces a replica loaded with other values, so changing one reloads the
# model at once. The others apply to the replicas as they are.
ENGINE_SETTINGS = frozenset({"batch_window_ms", "max_batch_size", "dtype", "quantization"})

_NAME = re.compile(DEPLOYMENT_NAME_PATTERN)


def _clean_settings(values: dict) -> dict:
    cleaned = {}
    for field, value in values.items():
        if field not in SETTINGS:
            raise InvalidDeployment(field, f"Unknown setting {field!r}.")
        if field in INT_SETTINGS:
            low, high = INT_SETTINGS[field]
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidDeployment(field, f"{field} must be a whole number.")
            if not low <= value <= high:
                raise InvalidDeployment(field, f"{field} must be between {low} and {high}.")
        elif field in CHOICE_SETTINGS:
            if value not in CHOICE_SETTINGS[field]:
                raise InvalidDeployment(field, f"{field} must be one of {', '.join(CHOICE_SETTINGS[field])}.")
        elif not isinstance(value, bool):
            raise InvalidDeployment(field, f"{field} must be true or false.")
        cleaned[field] = value
    return cleaned


def taken_message(name: str) -> str:
    return f"The name '{name}' is taken: choose another."


def _check_quota(deployment: Deployment, *, creating: bool, before: int = 0) -> None:
    """An organization may own ORG_MAX_DEPLOYMENTS deployments and reserve ORG_MAX_RESERVED_REPLICAS
    replicas (see ``reserved_replicas``): one organization's key must not be able to hold the
    whole fleet. The operator's deployments are not counted; a change that reserves no more than
    ``before`` always passes (an organization over a lowered limit can come down step by step).
    Two creations at the same moment may pass one over; the next change is checked again."""
    if deployment.organization_id is None:
        return
    others = Deployment.objects.filter(organization_id=deployment.organization_id).exclude(pk=deployment.pk)
    limit = django_settings.ORG_MAX_DEPLOYMENTS
    if creating and others.count() >= limit:
        raise InvalidDeployment("name", f"Your organization has {limit} deployments, its limit: delete one first "
                                        "(the operator sets ORG_MAX_DEPLOYMENTS).")
    mine = deployment.reserved_replicas
    if mine <= before:
        return
    reserved = mine + sum(d.reserved_replicas for d in others.only("min_replicas", "max_replicas",
                                                                    "scale_to_zero_seconds"))
    limit = django_settings.ORG_MAX_RESERVED_REPLICAS
    if reserved > limit:
        field = "scale_to_zero_seconds" if deployment.scale_to_zero_seconds == 0 and mine > deployment.min_replicas \
            else "min_replicas"
        raise InvalidDeployment(field, f"This would reserve {reserved} replicas for your organization (min_replicas, "
                                       f"or max_replicas of a deployment that never scales to zero), over its limit "
                                       f"of {limit} (the operator sets ORG_MAX_RESERVED_REPLICAS).")


def _check_can_pay(deployment: Deployment, *, before: int = 0) -> None:
    """A deployment that would hold more than ``before`` replicas billed by the hour: whoever
    receives ``signals.reserving_capacity`` (billing) may refuse (InvalidDeployment)."""
    if deployment.replicas_billed_hourly(deployment.max_replicas) > before:
        signals.reserving_capacity.send(sender=Deployment, deployment=deployment)


def _check_consistency(deployment: Deployment) -> None:
    if deployment.max_replicas < deployment.min_replicas:
        raise InvalidDeployment("max_replicas", "max_replicas must be at least min_replicas.")
    if deployment.kind == Deployment.Kind.DEDICATED and deployment.min_replicas < 1:
        raise InvalidDeployment("min_replicas", "A dedicated deployment keeps at least one replica (min_replicas >= 1).")


def _check_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidDeployment("name", "A deployment needs a name.")
    if not _NAME.fullmatch(name):  # match() lets "$" take a final newline
        raise InvalidDeployment(
            "name", "Use 1-100 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit."
        )
    return name


def create_deployment(
    *, organization: Organization | None, model: CatalogModel, name: str, created_by=None, **settings
) -> Deployment:
    """A new deployment of ``model``. ``organization=None`` makes an operator's deployment.

    Settings: kind, is_public, batch_window_ms, max_batch_size, queue_limit, min_replicas,
    max_replicas, scale_to_zero_seconds, dtype, quantization. Raises InvalidDeployment(field, message).
    """
    name = _check_name(name)
    if not isinstance(model, CatalogModel) or model.pk is None:
        raise InvalidDeployment("model", "Choose a model from the catalog.")
    if not model.is_active:
        raise InvalidDeployment("model", f"The model '{model.slug}' is not available.")
    cleaned = _clean_settings(settings)
    if organization is not None and cleaned.get("is_public"):
        raise InvalidDeployment("is_public", "Only the operator can publish a deployment to every organization.")
    if cleaned.get("kind") == Deployment.Kind.DEDICATED:
        cleaned.setdefault("min_replicas", 1)
        cleaned.setdefault("max_replicas", max(1, cleaned["min_replicas"]))
    deployment = Deployment(organization=organization, model=model, name=name, created_by=created_by, **cleaned)
    _check_consistency(deployment)
    _check_quota(deployment, creating=True)
    _check_can_pay(deployment)
    if deployment_name_taken(name=name):
        raise InvalidDeployment("name", taken_message(name))
    try:
        with transaction.atomic():
            deployment.save()
    except IntegrityError:  # a concurrent creation took the name
        raise InvalidDeployment("name", taken_message(name)) from None
    return deployment


def update_deployment(*, deployment: Deployment, **changes) -> Deployment:
    """Changes settings (see create_deployment). The name and the model are fixed for life: the name
    is the deployment's queue, the model its workers' weights."""
    _save_settings(deployment, changes)
    return deployment


def _save_settings(deployment: Deployment, changes: dict) -> set[str]:
    """``update_deployment``'s write; the settings whose value it changed."""
    for fixed in ("name", "model", "organization"):
        if fixed in changes:
            raise InvalidDeployment(fixed, f"The {fixed} of a deployment cannot be changed: create a new one.")
    cleaned = _clean_settings(changes)
    if deployment.organization_id is not None and cleaned.get("is_public"):
        raise InvalidDeployment("is_public", "An organization's deployment cannot be made public: only the "
                                             "operator's own deployments (created public) serve every organization.")
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().filter(pk=deployment.pk).first()
        if locked is None:  # deleted meanwhile
            raise DeploymentNotFound(deployment.name)
        if cleaned.get("kind") == Deployment.Kind.DEDICATED and "min_replicas" not in cleaned \
                and locked.min_replicas < 1:
            cleaned["min_replicas"] = 1  # as a new dedicated deployment gets (create_deployment)
        before = locked.reserved_replicas
        billed_before = locked.replicas_billed_hourly(locked.max_replicas)
        changed = {field for field, value in cleaned.items() if getattr(locked, field) != value}
        for field, value in cleaned.items():
            setattr(locked, field, value)
        _check_consistency(locked)
        _check_quota(locked, creating=False, before=before)
        # A stopped or failed one holds nothing until started or tried again (checked then).
        if locked.status not in (Deployment.Status.STOPPED, Deployment.Status.FAILED):
            _check_can_pay(locked, before=billed_before)
        locked.save(update_fields=[*cleaned, "updated_at"])
    # The status too, as read under the lock: what a retry (``retry_if_failed``) goes by.
    for field in [*cleaned, "updated_at", "status", "status_reason"]:
        setattr(deployment, field, getattr(locked, field))
    return changed


LOADS_NOTHING = "nothing"  # no engine setting changed (nor a retry): its replicas go on as they are
LOADS_NOW = "now"  # its replicas are replaced (or it is tried again): requests wait for the load
LOADS_ON_REQUEST = "on_request"  # scaled to zero: the next request's cold start loads it with them
LOADS_ON_START = "on_start"  # stopped: it loads with them once started


@dataclass(frozen=True)
class SettingsChange:
    deployment: Deployment
    loads: str  # when the model loads with the new settings: one of the LOADS_* above


def change_deployment_settings(*, deployment: Deployment, **changes) -> SettingsChange:
    """A user's change of the settings (the API's PATCH, the dashboard's settings): ``update_deployment``,
    and a failed deployment is tried again with them. Says when the model loads with them."""
    with transaction.atomic():  # the placement loop, woken on commit, sees the retry too
        changed = _save_settings(deployment, changes)
        retried = retry_if_failed(deployment=deployment, why="its settings changed")
    if not retried and not changed & ENGINE_SETTINGS:
        loads = LOADS_NOTHING
    elif deployment.status in STARTABLE:
        loads = LOADS_ON_START
    elif deployment.status == Deployment.Status.SCALED_TO_ZERO and deployment.min_replicas == 0:
        loads = LOADS_ON_REQUEST
    else:  # serving, coming up, or scaled to zero under a min_replicas the placement loop brings up now
        loads = LOADS_NOW
    return SettingsChange(deployment=deployment, loads=loads)


def retry_if_failed(*, deployment: Deployment, why: str) -> bool:
    """A failed deployment whose settings changed is tried again: back to pending, the placement
    loop loads it. Whether it was (not over a stop made meanwhile)."""
    if deployment.status != Deployment.Status.FAILED:
        return False
    _check_can_pay(deployment)  # it holds nothing while failed; tried again, it would
    return set_deployment_status(deployment=deployment, status=Deployment.Status.PENDING,
                                 reason=f"{why}: trying again", unless_stopped=True)


# The statuses ``start_deployment`` brings back.
STARTABLE = (Deployment.Status.STOPPED, Deployment.Status.FAILED)


def start_deployment(*, deployment: Deployment, reason: str) -> bool:
    """Serves a stopped deployment again, or tries a failed one again: back to pending, the
    placement loop loads it. Whether it did (one serving or coming up already is left alone)."""
    if deployment.status not in STARTABLE:
        return False
    _check_can_pay(deployment)
    return set_deployment_status(deployment=deployment, status=Deployment.Status.PENDING, reason=reason)


def stop_deployment(*, deployment: Deployment, reason: str) -> bool:
    """Stops serving it: the placement loop unloads it once its running requests are done, and
    its waiting ones get a 503. Whether it did (a stopped one is left alone)."""
    if deployment.status == Deployment.Status.STOPPED:
        return False
    return set_deployment_status(deployment=deployment, status=Deployment.Status.STOPPED, reason=reason)


def set_deployment_status(*, deployment: Deployment, status: str, reason: str = "",
                          unless_stopped: bool = False) -> bool:
    """Sets the status; with ``unless_stopped``, not over a stop (checked in the same statement: a
    stop that lands between a read and this write is kept). Whether it was set."""
    if status not in Deployment.Status.values:
        raise InvalidDeployment("status", f"status must be one of {', '.join(Deployment.Status.values)}.")
    now = timezone.now()
    rows = Deployment.objects.filter(pk=deployment.pk)
    if unless_stopped:
        rows = rows.exclude(status=Deployment.Status.STOPPED)
    if not rows.update(status=status, status_reason=reason, updated_at=now):
        return False
    read_cache.invalidate()
    deployment.status, deployment.status_reason, deployment.updated_at = status, reason, now
    return True


def delete_deployment(*, deployment: Deployment) -> None:
    """Removes the deployment; its name is free again afterwards."""
    Deployment.objects.filter(pk=deployment.pk).delete()


def _price(field: str, value) -> Decimal:
    """``value`` as the catalog stores it, or ModelImportError: never rounded or cut silently (a
    price of 0.00000001 stored as 0 would make a model free)."""
    try:
        price = Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise ModelImportError(f"{field}: not a price: {value!r}") from None
    if not price.is_finite() or price < 0:
        raise ModelImportError(f"{field}: a price must be a non-negative amount in USD")
    places = PRICE_FIELD["decimal_places"]
    if price >= Decimal(10) ** (PRICE_FIELD["max_digits"] - places):
        raise ModelImportError(f"{field}: {value} is too large (less than 10^{PRICE_FIELD['max_digits'] - places})")
    if price != price.quantize(Decimal(1).scaleb(-places)):
        raise ModelImportError(f"{field}: {value} has more than {places} decimal places")
    return price


def _unique_model_slug(base: str) -> str:
    base = slugify(base)[:90] or "model"
    slug, n = base, 1
    while CatalogModel.objects.filter(slug=slug).exists():
        n += 1
        slug = f"{base}-{n}"
    return slug


PRICE_FIELDS = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_per_request",
                "price_per_replica_hour")


def import_model(
    *, path: str | Path, slug: str | None = None, display_name: str | None = None, description: str = "",
    is_active: bool = True, check: Callable[[Path], int] | None = None, **prices,
) -> CatalogModel:
    """Adds the GGUF file or safetensors folder at ``path`` (absolute, or relative to MODELS_ROOT) to
    the catalog, filled from its metadata. Raises ModelImportError and writes nothing when the path
    leads outside MODELS_ROOT or the weights cannot be read. ``check(path)``: raises
    ModelImportError for weights the engine cannot run, else returns the context length it runs
    them with (``workers.services.import_model`` passes the engine's)."""
    unknown = set(prices) - set(PRICE_FIELDS)
    if unknown:
        raise ModelImportError(f"unknown field {sorted(unknown)[0]!r}")
    cleaned_prices = {field: _price(field, value) for field, value in prices.items()}
    resolved = path_under_models_root(path)
    if not resolved.exists():
        raise ModelImportError(missing_weights_message(path))
    info = inspect_weights(resolved)
    if check is not None:
        info = dataclasses.replace(info, context_length=check(resolved))
    stored_path = str(resolved.relative_to(models_root()))
    existing = CatalogModel.objects.filter(weights_path=stored_path).first()
    if existing is not None:
        raise ModelImportError(f"{stored_path} is already in the catalog as '{existing.slug}'")
    stem = resolved.stem if resolved.is_file() else resolved.name
    if slug is not None:
        slug = slugify(slug)
        if not slug:
            raise ModelImportError("slug: use letters, digits, '-' or '_'")
        if CatalogModel.objects.filter(slug=slug).exists():
            raise ModelImportError(f"slug: '{slug}' is already in the catalog")
    try:
        with transaction.atomic():
            return CatalogModel.objects.create(
                slug=slug or _unique_model_slug(stem),
                display_name=display_name or info.name or stem,
                architecture=info.architecture,
                parameter_count=info.parameter_count,
                context_length=info.context_length,
                quantization=info.quantization,
                weights_path=stored_path,
                license=info.license[:100],
                description=description,
                is_active=is_active,
                **cleaned_prices,
            )
    except (IntegrityError, DataError) as exc:  # DataError: a figure the database cannot hold
        raise ModelImportError(f"cannot add {stored_path} to the catalog: {exc}") from None


def update_catalog_model(*, catalog_model: CatalogModel, **changes) -> CatalogModel:
    """Changes prices, names, description or availability of a catalog model."""
    allowed = set(PRICE_FIELDS) | {"display_name", "description", "license", "is_active"}
    for field, value in changes.items():
        if field not in allowed:
            raise InvalidCatalogModel(field, f"{field} cannot be changed")
        if field in PRICE_FIELDS:
            try:
                value = _price(field, value)
            except ModelImportError as exc:
                raise InvalidCatalogModel(field, exc.message) from None
        setattr(catalog_model, field, value)
    catalog_model.save(update_fields=list(changes))
    return catalog_model


BUNDLED_SLUG = "smollm2-135m-instruct"
# What the bundled file says about itself, for when its package is not installed yet.
_BUNDLED_FALLBACK = {"architecture": "llama", "parameter_count": 134_515_008, "quantization": "Q4_1", "context_length": 8192}


class SeedResult:
    def __init__(self):
        self.messages: list[str] = []
        self.warnings: list[str] = []


@transaction.atomic
def seed_catalog() -> SeedResult:
    """The bundled model and its public serverless deployment; idempotent (existing rows are kept)."""
    from .models import BUNDLED_PREFIX
    from .weights import WeightsNotFound, bundled_weights_path, inspect_gguf

    result = SeedResult()
    model = CatalogModel.objects.filter(slug=BUNDLED_SLUG).first()
    if model is None:
        metadata = dict(_BUNDLED_FALLBACK)
        try:
            info = inspect_gguf(bundled_weights_path(BUNDLED_SLUG))
        except (WeightsNotFound, ModelImportError) as exc:
            result.warnings.append(f"warning: {exc.message}; the catalog entry uses the known metadata")
        else:
            metadata = {"architecture": info.architecture, "parameter_count": info.parameter_count,
                        "quantization": info.quantization, "context_length": info.context_length}
        model = CatalogModel.objects.create(
            slug=BUNDLED_SLUG,
            display_name="SmolLM2 135M Instruct",
            weights_path=f"{BUNDLED_PREFIX}{BUNDLED_SLUG}",
            license="apache-2.0",
            description="A small instruction-tuned Llama-architecture model from Hugging Face (SmolLM2), "
                        "shipped with the platform in GGUF Q4_1 so it runs anywhere, CPU included.",
            price_input_per_mtok=Decimal("0.05"),
            price_cached_input_per_mtok=Decimal("0.025"),
            price_output_per_mtok=Decimal("0.10"),
            price_per_request=Decimal("0"),
            price_per_replica_hour=Decimal("0.20"),
            **metadata,
        )
        result.messages.append(f"added the catalog model {model.slug}")
    if not Deployment.objects.filter(name=BUNDLED_SLUG).exists():
        Deployment.objects.create(
            organization=None, model=model, name=BUNDLED_SLUG, kind=Deployment.Kind.SERVERLESS, is_public=True,
            batch_window_ms=20, max_batch_size=32, status=Deployment.Status.PENDING,  # the fleet says when it is ready
        )
        result.messages.append(f"added the public serverless deployment {BUNDLED_SLUG}")
    return result
