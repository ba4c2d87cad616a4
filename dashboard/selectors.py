"""Reads behind the dashboard's pages. Every function that concerns an organization takes it and
reads only its rows (or the public deployments every organization may call)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

from django.db import DatabaseError, connection
from django.db.models import Count, F, FloatField, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce, TruncHour, TruncMinute
from django.utils import timezone as dj_timezone

from accounts.models import ApiKey, Membership, Organization, User
from accounts.selectors import api_keys_for_organization, leave_refusal, organizations_for_user
from billing import selectors as billing_selectors
from billing.events import RESERVED_CAPACITY
from billing.models import UsageRecord
from billing.pricing import FREE, STATUSES, Prices, request_cost
from models_catalog.models import CatalogModel, Deployment
from models_catalog.selectors import deployments_of, deployments_visible_to

from .models import Invitation

log = logging.getLogger(__name__)

_MONEY_ZERO = Value(Decimal(0), output_field=UsageRecord._meta.get_field("cost"))


# --- the organization switcher ----------------------------------------------------------------------


def memberships_of(*, user: User) -> QuerySet[Membership]:
    """The user's memberships with their organizations, in the order they joined."""
    return Membership.objects.filter(user=user).select_related("organization").order_by("created_at", "id")


def role_in(*, user: User, organization: Organization | None) -> str | None:
    if organization is None or not getattr(user, "is_authenticated", False):
        return None
    return Membership.objects.filter(user=user, organization=organization).values_list("role", flat=True).first()


# --- overview ---------------------------------------------------------------------------------------


def overview(*, organization: Organization) -> dict:
    """The home page's figures: balance, this month's spend, the last 7 days of traffic, and what
    the organization has set up so far (for the getting-started checklist)."""
    today = dj_timezone.now().astimezone(timezone.utc).date()
    start = today - timedelta(days=6)
    report = billing_selectors.usage_report(organization=organization, start=start, end=today, group_by="day")
    has_usage = UsageRecord.objects.filter(billing_selectors.IS_REQUEST, organization=organization).exists()
    return {
        "balance": billing_selectors.balance(organization=organization),
        "monthly_spend": billing_selectors.monthly_spend(organization=organization),
        "week": report["totals"],
        "week_series": {
            "labels": [bucket["key"].date().isoformat() for bucket in report["buckets"]],
            "requests": [bucket["requests"] for bucket in report["buckets"]],
            "tokens": [bucket["total_tokens"] for bucket in report["buckets"]],
        },
        "deployments": deployments_of(organization=organization)[:6],
        "deployment_count": deployments_of(organization=organization).count(),
        "key_count": api_keys_for_organization(organization=organization).count(),
        "has_usage": has_usage,
        "has_topup": organization.ledger_entries.filter(kind="topup").exists(),
    }


# --- the catalog --------------------------------------------------------------------------------------

SIZE_FILTERS = {
    "small": (0, 3_000_000_000, "Under 3B"),
    "medium": (3_000_000_000, 15_000_000_000, "3B to 15B"),
    "large": (15_000_000_000, None, "Over 15B"),
}


def catalog(*, search: str = "", architecture: str = "", quantization: str = "", size: str = "") -> QuerySet[CatalogModel]:
    """Active catalog models matching the filters (each optional)."""
    models = CatalogModel.objects.filter(is_active=True)
    search = (search or "").strip()
    if search:
        models = models.filter(Q(slug__icontains=search) | Q(display_name__icontains=search)
                               | Q(description__icontains=search) | Q(architecture__icontains=search))
    if architecture:
        models = models.filter(architecture=architecture)
    if quantization:
        models = models.filter(quantization=quantization)
    if size in SIZE_FILTERS:
        low, high, _ = SIZE_FILTERS[size]
        models = models.filter(parameter_count__gte=low)
        if high is not None:
            models = models.filter(parameter_count__lt=high)
    return models.order_by("display_name", "slug")


def catalog_filter_options() -> dict:
    active = CatalogModel.objects.filter(is_active=True)
    return {
        "architectures": sorted(set(active.exclude(architecture="").values_list("architecture", flat=True))),
        "quantizations": sorted(set(active.exclude(quantization="").values_list("quantization", flat=True))),
        "sizes": [(key, label) for key, (_, _, label) in SIZE_FILTERS.items()],
    }


def catalog_model(*, slug: str) -> CatalogModel | None:
    return CatalogModel.objects.filter(slug=slug, is_active=True).first()


def deployments_of_model(*, organization: Organization, model: CatalogModel) -> list[Deployment]:
    """The deployments of ``model`` the organization may call: its own first, then public ones."""
    visible = deployments_visible_to(organization=organization).filter(model=model)
    return sorted(visible, key=lambda d: (d.organization_id != organization.pk, d.name))


# --- deployments ----------------------------------------------------------------------------------


def deployments_page(*, organization: Organization) -> dict:
    """The organization's deployments and the public ones it may call, with each one's requests by
    this organization over the last 24 hours."""
    since = dj_timezone.now() - timedelta(hours=24)
    visible = list(deployments_visible_to(organization=organization))
    counts = dict(
        UsageRecord.objects.filter(billing_selectors.IS_REQUEST, organization=organization, created_at__gte=since,
                                   deployment_id__in=[d.pk for d in visible])
        .values("deployment_id").annotate(n=Count("id")).values_list("deployment_id", "n")
    )
    for deployment in visible:
        deployment.requests_24h = counts.get(deployment.pk, 0)
    return {
        "own": [d for d in visible if d.organization_id == organization.pk],
        "public": [d for d in visible if d.organization_id != organization.pk],
    }


def deployment_for(*, organization: Organization, name: str) -> Deployment | None:
    """A deployment the organization may see: its own, or a public one (None otherwise, whether or
    not another organization has one of that name)."""
    return deployments_visible_to(organization=organization).filter(name=name).first()


WINDOWS = {
    "1h": (timedelta(hours=1), 60, TruncMinute),
    "24h": (timedelta(hours=24), 3600, TruncHour),
    "7d": (timedelta(days=7), 3600, TruncHour),
}


def _floor(moment: datetime, seconds: int) -> datetime:
    epoch = int(moment.timestamp())
    return datetime.fromtimestamp(epoch - epoch % seconds, tz=timezone.utc)


def deployment_metrics(*, organization: Organization, deployment: Deployment, window: str = "1h",
                       now: datetime | None = None) -> dict:
    """The organization's traffic on ``deployment`` over ``window`` (1h by minute, 24h and 7d by
    hour), from its usage records: requests per minute, output tokens per second, p50/p99 latency
    (ms), and the average batch size: the engine's tokens per step while it decoded these
    requests, weighted by each request's output tokens."""
    span, bucket_s, trunc = WINDOWS.get(window, WINDOWS["1h"])
    now = (now or dj_timezone.now()).astimezone(timezone.utc)
    end = _floor(now, bucket_s) + timedelta(seconds=bucket_s)
    start = end - span
    billed = UsageRecord.objects.filter(organization=organization, deployment=deployment,
                                        created_at__gte=start, created_at__lt=end)
    records = billed.filter(billing_selectors.IS_REQUEST)  # the traffic; its reserved replicas are in the cost
    sums = {
        "requests": Count("id"),
        "completion_tokens": Coalesce(Sum("completion_tokens"), Value(0)),
        "prompt_tokens": Coalesce(Sum("prompt_tokens"), Value(0)),
        # Requests the engine reported no batch size for (failed before a token) weigh nothing.
        "batch_weighted": Sum("batch_weight", output_field=FloatField()),
        "batch_tokens": Sum("batched_tokens", filter=Q(mean_batch_size__isnull=False)),
    }
    postgres = connection.vendor == "postgresql"
    if postgres:
        sums["p50"] = billing_selectors.PercentileDisc("latency_ms", 0.5)
        sums["p99"] = billing_selectors.PercentileDisc("latency_ms", 0.99)
    rows = {
        row["bucket"]: row
        for row in records.annotate(bucket=trunc("created_at", tzinfo=timezone.utc),
                                    batch_weight=F("mean_batch_size") * F("completion_tokens"),
                                    batched_tokens=F("completion_tokens")).order_by()
        .values("bucket").annotate(**sums)
    }
    if not postgres:
        latencies: dict[datetime, list[int]] = {}
        for moment, latency in records.filter(latency_ms__isnull=False).order_by("latency_ms").values_list(
                "created_at", "latency_ms"):
            latencies.setdefault(_floor(moment, bucket_s), []).append(latency)
        for bucket, values in latencies.items():
            if bucket not in rows:
                continue
            rows[bucket]["p50"] = billing_selectors.percentile_disc(values, 0.5)
            rows[bucket]["p99"] = billing_selectors.percentile_disc(values, 0.99)

    series = {"labels": [], "requests_per_min": [], "tokens_per_s": [], "p50_ms": [], "p99_ms": [], "batch": []}
    moment = start
    while moment < end:
        row = rows.get(moment)
        series["labels"].append(moment.isoformat())
        if row is None:
            for key in ("requests_per_min", "tokens_per_s"):
                series[key].append(0)
            series["batch"].append(None)
            series["p50_ms"].append(None)
            series["p99_ms"].append(None)
        else:
            series["requests_per_min"].append(round(row["requests"] * 60 / bucket_s, 3))
            series["tokens_per_s"].append(round(row["completion_tokens"] / bucket_s, 3))
            series["p50_ms"].append(row.get("p50"))
            series["p99_ms"].append(row.get("p99"))
            series["batch"].append(round(row["batch_weighted"] / row["batch_tokens"], 2)
                                   if row["batch_tokens"] else None)
        moment += timedelta(seconds=bucket_s)

    totals = billed.aggregate(
        requests=Count("id", filter=billing_selectors.IS_REQUEST),
        completion_tokens=Coalesce(Sum("completion_tokens"), Value(0)),
        prompt_tokens=Coalesce(Sum("prompt_tokens"), Value(0)),
        cost=Coalesce(Sum("cost"), _MONEY_ZERO),
        replica_seconds=Coalesce(Sum("replica_seconds"), Value(0)),
        failed=Count("id", filter=Q(status="failed")),
        cancelled=Count("id", filter=Q(status="cancelled")),
    )
    latencies = sorted(records.filter(latency_ms__isnull=False).values_list("latency_ms", flat=True)) \
        if totals["requests"] <= 100_000 else []
    totals["p50_ms"] = billing_selectors.percentile_disc(latencies, 0.5)
    totals["p99_ms"] = billing_selectors.percentile_disc(latencies, 0.99)
    ttfts = sorted(records.filter(ttft_ms__isnull=False).values_list("ttft_ms", flat=True)[:100_000])
    totals["ttft_p50_ms"] = billing_selectors.percentile_disc(ttfts, 0.5)
    return {"window": window if window in WINDOWS else "1h", "bucket_s": bucket_s, "series": series,
            "totals": totals}


def recent_requests(*, organization: Organization, deployment: Deployment | None = None, limit: int = 20):
    records = UsageRecord.objects.filter(billing_selectors.IS_REQUEST, organization=organization).select_related("api_key")
    if deployment is not None:
        records = records.filter(deployment=deployment)
    return list(records.order_by("-created_at", "-id")[:limit])


# --- API keys ---------------------------------------------------------------------------------------


def api_keys_with_spend(*, organization: Organization, include_revoked: bool = True) -> list[ApiKey]:
    """The organization's keys, newest first, each with ``spend`` (USD), ``tokens`` and ``requests``
    over its lifetime, from billing's running totals (however many requests the keys made), and
    ``amount_limit``, the USD it may spend (None: no limit)."""
    keys = list(api_keys_for_organization(organization=organization, include_revoked=include_revoked)
                .select_related("spend_limit"))
    figures = billing_selectors.api_key_totals(api_keys=keys)
    now = dj_timezone.now()
    for key in keys:
        key.spend, key.tokens, key.requests = figures.get(key.pk, (billing_selectors.ZERO, 0, 0))
        limit = getattr(key, "spend_limit", None)  # no row: never limited
        key.amount_limit = limit.amount_limit if limit is not None else None
        key.state = "revoked" if key.revoked_at else ("expired" if key.is_expired(now) else "active")
    return keys


def api_key_of(*, organization: Organization, key_id: int) -> ApiKey | None:
    return ApiKey.objects.filter(organization=organization, pk=key_id).first()


# --- usage and cost -----------------------------------------------------------------------------------


def usage_page(*, organization: Organization, start: date, end: date) -> dict:
    """The usage page: totals, by day, by model, by API key, by endpoint, and the latest requests."""
    by_day = billing_selectors.usage_report(organization=organization, start=start, end=end, group_by="day")
    by_model = billing_selectors.usage_report(organization=organization, start=start, end=end, group_by="model")
    by_key = billing_selectors.usage_report(organization=organization, start=start, end=end, group_by="api_key")
    by_endpoint = billing_selectors.usage_report(organization=organization, start=start, end=end,
                                                 group_by="endpoint")
    records = billing_selectors.usage_records(organization=organization, start=start, end=end)
    return {
        "totals": by_day["totals"],
        "by_day": by_day["buckets"],
        "by_model": sorted(by_model["buckets"], key=lambda b: b["cost"], reverse=True),
        "by_key": sorted(by_key["buckets"], key=lambda b: b["cost"], reverse=True),
        "by_endpoint": sorted(by_endpoint["buckets"], key=lambda b: b["cost"], reverse=True),
        # The by-key table's last row, so that it adds up to the totals (no key reserves capacity).
        "reserved": next((b for b in by_endpoint["buckets"] if b["key"] == RESERVED_CAPACITY), None),
        "recent": list(records.filter(billing_selectors.IS_REQUEST).select_related("api_key")
                       .order_by("-created_at", "-id")[:50]),
        "chart": {
            "labels": [b["key"].date().isoformat() for b in by_day["buckets"]],
            "requests": [b["requests"] for b in by_day["buckets"]],
            "prompt_tokens": [b["prompt_tokens"] for b in by_day["buckets"]],
            "completion_tokens": [b["completion_tokens"] for b in by_day["buckets"]],
            "cost": [str(b["cost"]) for b in by_day["buckets"]],
            "models": [b["key"] for b in by_model["buckets"]],
            "model_cost": [str(b["cost"]) for b in by_model["buckets"]],
            "model_tokens": [b["total_tokens"] for b in by_model["buckets"]],
        },
    }


# --- the playground ---------------------------------------------------------------------------------


def playground_deployments(*, organization: Organization) -> list[Deployment]:
    """What the playground can talk to: the organization's deployments first, then public ones."""
    visible = list(deployments_visible_to(organization=organization))
    return sorted(visible, key=lambda d: (d.organization_id != organization.pk, d.name))


@dataclass(frozen=True)
class ReplyCost:
    source: str  # "billed": from the usage record; "estimated": computed with the model's prices
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    cost: Decimal
    status: str


def reply_cost(*, organization: Organization, request_id: str, deployment: Deployment | None,
               prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int,
               status: str = "completed") -> ReplyCost | None:
    """The cost of one playground reply: its usage record when billing has recorded it, else the
    same computation billing will make (``billing.pricing.request_cost``) with the deployment's
    model prices. None when neither is possible (unknown deployment, bad counts)."""
    record = UsageRecord.objects.filter(organization=organization, request_id=request_id).first()
    if record is not None:
        return ReplyCost("billed", record.prompt_tokens, record.cached_prompt_tokens, record.completion_tokens,
                         record.cost, record.status)
    if deployment is None or status not in STATUSES:
        return None
    try:
        prices = FREE if deployment.is_billed_by_the_hour else Prices.of(deployment.model)
        cost = request_cost(prices=prices, prompt_tokens=prompt_tokens,
                            cached_prompt_tokens=cached_prompt_tokens, completion_tokens=completion_tokens,
                            status=status)
    except (TypeError, ValueError):
        return None
    return ReplyCost("estimated", prompt_tokens, cached_prompt_tokens, completion_tokens, cost, status)


# --- members ------------------------------------------------------------------------------------------


def members_page(*, organization: Organization, user: User) -> dict:
    """The organization's members and pending invitations, and why ``user`` cannot leave it (None
    when they can)."""
    now = dj_timezone.now()
    memberships = list(Membership.objects.filter(organization=organization).select_related("user")
                       .order_by("created_at", "id"))
    own = next((m for m in memberships if m.user_id == user.pk), None)
    return {
        "memberships": memberships,
        "invitations": list(Invitation.objects.filter(organization=organization, accepted_at__isnull=True,
                                                      revoked_at__isnull=True, expires_at__gt=now)
                            .select_related("invited_by")),
        "leave_refusal": leave_refusal(membership=own) if own is not None else None,
    }


# --- operator pages -------------------------------------------------------------------------------------


def all_deployments() -> QuerySet[Deployment]:
    """Every deployment of every organization (operator only)."""
    return Deployment.objects.select_related("model", "organization").order_by("organization_id", "name")


def _heartbeats() -> dict[str, dict]:
    """The fleet's heartbeat rows by worker hostname ({} until the workers app records them)."""
    try:
        from workers import selectors as fleet_selectors

        rows = list(fleet_selectors.workers(include_gone=True))
    except (ImportError, AttributeError, TypeError, DatabaseError):
        return {}
    beats = {}
    for worker in rows:
        replicas = list(worker.replicas.all())
        beats[worker.hostname] = {
            "device": worker.device,
            "status": worker.status,
            "last_heartbeat": worker.last_heartbeat,
            "slots": worker.slots,
            "replicas": [{"name": r.deployment_name, "status": r.status, "in_flight": r.in_flight} for r in replicas],
            "queue_depths": worker.queue_depths or {},
            "kv_capacity_tokens": _kv_capacity(worker.engine_stats or {}) if worker.status == "alive" else None,
        }
    return beats


def _kv_capacity(engine_stats: dict) -> int | None:
    """Tokens the KV caches of a worker's engines hold together (None before any engine reports it)."""
    sizes = [(hosted.get("engine") or {}).get("kv_capacity_tokens") for hosted in engine_stats.values()]
    sizes = [size for size in sizes if isinstance(size, int)]
    return sum(sizes) if sizes else None


def _answering(timeout: float) -> dict[str, dict]:
    """Workers answering Celery's remote control now: their queues, pid, pool and task counts."""
    from inference_platform.celery import app

    inspect = app.control.inspect(timeout=timeout)
    queues = inspect.active_queues() or {}
    stats = (inspect.stats() or {}) if queues else {}
    answering = {}
    for name in set(queues) | set(stats):
        info = stats.get(name, {})
        pool = info.get("pool") if isinstance(info.get("pool"), dict) else {}
        totals = info.get("total") if isinstance(info.get("total"), dict) else {}
        answering[name] = {
            "queues": [q.get("name", "") for q in queues.get(name, [])],
            "pid": info.get("pid"),
            "concurrency": pool.get("max-concurrency"),
            "processed": sum(totals.values()) if totals else 0,
            "uptime_s": info.get("uptime"),
        }
    return answering


def fleet_workers(*, timeout: float = 1.0) -> tuple[list[dict], str | None]:
    """Every worker the platform knows: those answering Celery's remote control now (what queues
    they consume, their pool, their task counts) merged with the fleet's heartbeats where a worker
    sends them (its device, last heartbeat, the replicas it hosts); a worker whose heartbeats
    stopped shows as gone. Each: name, state, device, deployments served, other queues, pid,
    concurrency, tasks processed, uptime, last heartbeat, KV cache capacity in tokens. And why
    no worker could be asked, if the broker failed (the heartbeats, in the database, still show)."""
    from kombu.exceptions import OperationalError
    from redis.exceptions import RedisError

    try:
        answering, broker_error = _answering(timeout), None
    except (OperationalError, RedisError, OSError) as exc:  # a restarted or frozen Redis
        log.warning("could not ask the workers through the broker: %s", exc)
        answering, broker_error = {}, f"{type(exc).__name__}: {exc}"
    beats = _heartbeats()
    workers = []
    for name in sorted(set(answering) | set(beats)):
        live, beat = answering.get(name), beats.get(name)
        queues = live["queues"] if live else []
        served = {q.split(".", 1)[1] for q in queues if q.startswith("deployment.")}
        replicas = beat["replicas"] if beat else []
        served |= {r["name"] for r in replicas}
        workers.append({
            "name": name,
            "state": "answering" if live else (beat or {}).get("status", "gone"),
            "device": beat["device"] if beat else None,
            "deployments": sorted(served),
            "loading": sorted(r["name"] for r in replicas if r["status"] == "loading"),
            "queues": sorted(q for q in queues if not q.startswith("deployment.")),
            "pid": live["pid"] if live else None,
            "concurrency": live["concurrency"] if live else None,
            "processed": live["processed"] if live else None,
            "uptime_s": live["uptime_s"] if live else None,
            "last_heartbeat": beat["last_heartbeat"] if beat else None,
            "slots": beat["slots"] if beat else None,
            "kv_capacity_tokens": beat["kv_capacity_tokens"] if beat else None,
        })
    return workers, broker_error


def importable_weights(*, root: Path, limit: int = 50) -> list[str]:
    """GGUF files and Hugging Face folders (with config.json) under the models root that are not in
    the catalog yet, as paths relative to the root, in path order. The walk stops at ``limit`` and
    does not go into a candidate folder (its files are one model) nor into hidden folders: a
    large models volume is not read whole for one page."""
    if not root.is_dir():
        return []
    known = set(CatalogModel.objects.values_list("weights_path", flat=True))
    resolved_root = root.resolve()
    found: list[str] = []
    visited: set[Path] = set()  # folders by where they lead: a link back up is not walked again

    def visit(folder: Path) -> None:
        try:
            where = folder.resolve()
            entries = sorted(folder.iterdir())
        except (OSError, RuntimeError):  # unreadable, or a loop of links (RuntimeError before 3.13)
            return
        if where in visited:
            return
        visited.add(where)
        for path in entries:
            if len(found) >= limit:
                return
            try:
                if path.name.startswith(".") or not path.resolve().is_relative_to(resolved_root):
                    continue  # hidden, or a link leading out (the import would refuse it)
                if path.is_dir():
                    if (path / "config.json").is_file():
                        offer(path)
                    else:
                        visit(path)
                elif path.suffix.lower() == ".gguf":
                    offer(path)
            except (OSError, RuntimeError):  # this one cannot be read: the others still can
                continue

    def offer(path: Path) -> None:
        relative = str(path.relative_to(root))
        if relative not in known:
            found.append(relative)

    visit(root)
    return found


def humanize_count(value: int | None) -> str:
    """135000000 → "135M", 7241732096 → "7.2B"."""
    if value is None:
        return "—"
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= threshold:
            number = value / threshold
            return f"{number:.1f}".rstrip("0").rstrip(".") + suffix if number < 10 else f"{math.floor(number)}{suffix}"
    return str(value)
