"""The billing REST API: usage reports, the CSV export, balance, ledger, spend limits and top-ups.

Callers: an API key with the ``read_usage`` scope (``Authorization: Bearer sk-...``), or the
dashboard's logged-in user (session; the session's current organization). Top-ups and changes to
the spend limit need the ``manage`` scope or the dashboard (where changing the limit takes an owner
or an admin). Every answer concerns the caller's organization only. Errors follow OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import csv
import logging
from decimal import Decimal
from typing import Iterable, Iterator

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions as drf_exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api_errors import drf_error_response, error_response, logged_as_expected
from accounts.authentication import ApiKeyAuthentication, key_actor
from accounts.middleware import SESSION_ORGANIZATION_KEY
from accounts.models import ApiKey
from accounts.permissions import require_scope
from accounts.selectors import current_organization_for_user

from . import selectors, serializers, services
from .errors import BillingError

log = logging.getLogger(__name__)
EXPORT_CHUNK_ROWS = 2000

_PERIOD = [
    OpenApiParameter("start", OpenApiTypes.DATE, description="first day, UTC (default: 29 days before end)"),
    OpenApiParameter("end", OpenApiTypes.DATE, description="last day, inclusive, UTC (default: today); at most 366 days"),
]
_ERROR = OpenApiResponse(description='{"error": {"message", "type", "param", "code"}}')
_ERRORS = {400: _ERROR, 401: _ERROR, 403: _ERROR}

def billing_exception_handler(exc, context):
    """BillingError and DRF's own errors, rendered in OpenAI's shape; anything else: a 500."""
    if isinstance(exc, BillingError):
        response = error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)
        return logged_as_expected(response, code=exc.code, message=exc.message, logger=log) if exc.expected else response
    if isinstance(exc, drf_exceptions.APIException):
        return drf_error_response(exc, context)
    return None


def _session_user(request):
    """The dashboard's logged-in user making the call; None for an API key."""
    return request.user if getattr(request.user, "pk", None) and not isinstance(request.auth, ApiKey) else None


def _key_creator(request):
    """The member who created the calling API key: a key acts with its creator's role, so that a
    member cannot lift the organization's limit with a ``manage`` key of their own. None for a key
    the operator's command line made for no user (``key_actor``)."""
    return key_actor(request.auth) if isinstance(request.auth, ApiKey) else None


class BillingAPIView(APIView):
    authentication_classes = [ApiKeyAuthentication, SessionAuthentication]
    permission_classes = [require_scope("read_usage")]

    def get_exception_handler(self):
        return billing_exception_handler

    def organization(self, request):
        """The caller's organization: the key's, or the session user's current one."""
        if isinstance(request.auth, ApiKey):
            return request.auth.organization
        organization = current_organization_for_user(
            user=request.user, organization_id=request.session.get(SESSION_ORGANIZATION_KEY)
        )
        if organization is None:
            raise drf_exceptions.PermissionDenied("Your account does not belong to an organization yet.")
        return organization


class UsageReportView(BillingAPIView):
    """``GET /v1/usage?start=YYYY-MM-DD&end=YYYY-MM-DD&group_by=day|hour|model|deployment|api_key|endpoint``"""

    @extend_schema(
        parameters=[*_PERIOD, OpenApiParameter("group_by", str, enum=list(selectors.GROUP_BYS), default="day")],
        responses={200: serializers.UsageReportSerializer, **_ERRORS},
    )
    def get(self, request):
        start, end = serializers.parse_period(request.query_params)
        group_by = serializers.parse_group_by(request.query_params)
        report = selectors.usage_report(organization=self.organization(request), start=start, end=end,
                                        group_by=group_by)
        return Response(serializers.usage_report(report, start=start, end=end, group_by=group_by))


class _Echo:
    """A file-like object whose write returns the line, for csv.writer in a generator."""

    def write(self, value: str) -> str:
        return value


# What a spreadsheet reads as the start of a formula: a text cell (a key's name, which any member
# sets) beginning with one is written with a leading apostrophe, so that opening the export runs
# nothing (OWASP's advice against CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(value) -> object:
    if value is None:
        return ""
    if isinstance(value, Decimal):
        return format(value, "f")  # 0.0000000000, not str()'s 0E-10
    if isinstance(value, str):
        return "'" + value if value.startswith(FORMULA_STARTS) else value
    return value.isoformat() if hasattr(value, "isoformat") else value


def _csv_lines(rows: Iterable[tuple]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(selectors.EXPORT_COLUMNS)
    for row in rows:
        yield writer.writerow([_cell(value) for value in row])


def _next_chunk(lines: Iterator[str], size: int) -> str:
    """Up to ``size`` CSV lines joined (run in the database's thread under ASGI)."""
    out = []
    for line in lines:
        out.append(line)
        if len(out) >= size:
            break
    return "".join(out)


async def _async_chunks(lines: Iterator[str], size: int):
    """Under ASGI a synchronous iterator would be read whole into memory before the first byte is
    sent; this pulls ``size`` lines at a time from the server-side cursor in a worker thread."""
    next_chunk = sync_to_async(_next_chunk, thread_sensitive=True)
    while True:
        chunk = await next_chunk(lines, size)
        if not chunk:
            break
        yield chunk


class UsageExportView(BillingAPIView):
    """``GET /v1/usage/export.csv?start&end``: the raw usage records, streamed as CSV."""

    @extend_schema(parameters=_PERIOD, responses={
        (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="columns: " + ", ".join(selectors.EXPORT_COLUMNS)),
        **_ERRORS,
    })
    def get(self, request):
        start, end = serializers.parse_period(request.query_params)
        rows = selectors.usage_export_rows(organization=self.organization(request), start=start, end=end,
                                           chunk_size=EXPORT_CHUNK_ROWS)
        lines = _csv_lines(rows)
        if isinstance(request._request, ASGIRequest):
            content = _async_chunks(lines, EXPORT_CHUNK_ROWS)
        else:
            content = lines
        response = StreamingHttpResponse(content, content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="usage-{start.isoformat()}-{end.isoformat()}.csv"'
        return response


class BalanceView(BillingAPIView):
    """``GET /v1/billing/balance``"""

    @extend_schema(responses={200: serializers.BalanceSerializer, **_ERRORS})
    def get(self, request):
        organization = self.organization(request)
        limit = selectors.organization_monthly_limit(organization=organization)
        return Response({
            "object": "billing.balance",
            "balance": serializers.money(selectors.balance(organization=organization)),
            "currency": "usd",
            "monthly_spend": serializers.money(selectors.monthly_spend(organization=organization)),
            "monthly_limit": serializers.money(limit) if limit is not None else None,
        })


class LedgerView(BillingAPIView):
    """``GET /v1/billing/ledger?limit=20&after=<entry id>``: newest first, cursor-paginated."""

    @extend_schema(
        parameters=[OpenApiParameter("limit", int, description="1-100, default 20"),
                    OpenApiParameter("after", int, description="the last_id of the previous page")],
        responses={200: serializers.LedgerPageSerializer, **_ERRORS},
    )
    def get(self, request):
        limit, after = serializers.parse_ledger_page(request.query_params)
        entries, has_more = selectors.ledger_page(organization=self.organization(request), limit=limit, after=after)
        data = serializers.LedgerEntrySerializer(entries, many=True).data
        return Response({
            "object": "list",
            "data": data,
            "has_more": has_more,
            "first_id": entries[0].pk if entries else None,
            "last_id": entries[-1].pk if entries else None,
        })


class TopUpView(BillingAPIView):
    """``POST /v1/billing/topups {"amount": "20.00"}``: a PaymentIntent to confirm with Stripe.js."""

    permission_classes = [require_scope("manage")]

    @extend_schema(request=serializers.TopUpRequestSerializer,
                   responses={201: serializers.TopUpSerializer, 502: _ERROR, 503: _ERROR, **_ERRORS})
    def post(self, request):
        body = serializers.TopUpRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        intent = services.create_topup(organization=self.organization(request), amount=body.validated_data["amount"],
                                       created_by=_session_user(request))
        return Response({
            "object": "billing.topup",
            "id": intent.id,
            "client_secret": intent.client_secret,
            "amount": str(intent.amount),
            "currency": intent.currency,
            "publishable_key": settings.STRIPE_PUBLISHABLE_KEY,
        }, status=201)


class SpendLimitView(BillingAPIView):
    """``GET /v1/billing/limits``; ``PUT /v1/billing/limits {"monthly_limit": "100.00" | null}``."""

    def get_permissions(self):
        method = getattr(self.request, "method", "GET")  # the schema generator may ask without a request
        scope = "read_usage" if method in ("GET", "HEAD", "OPTIONS") else "manage"
        return [require_scope(scope)()]

    def _answer(self, organization) -> Response:
        limits = selectors.organization_limits(organization=organization)
        return Response({
            "object": "billing.spend_limit",
            **{name: serializers.money(value) if value is not None else None for name, value in limits.items()},
            "monthly_spend": serializers.money(selectors.monthly_spend(organization=organization)),
            "currency": "usd",
        })

    @extend_schema(responses={200: serializers.SpendLimitSerializer, **_ERRORS})
    def get(self, request):
        return self._answer(self.organization(request))

    @extend_schema(request=serializers.SpendLimitRequestSerializer,
                   responses={200: serializers.SpendLimitSerializer, **_ERRORS},
                   description="Set the organization's monthly spend limit (requests are refused with 429 "
                               "insufficient_quota once this calendar month's spend reaches it), its balance alert "
                               "(owners and admins are emailed when the balance falls below it) and its spend alert "
                               "(emailed once a month when the month's spend reaches it); null removes "
                               "one, one left out stays. An API key needs the manage scope; a dashboard user must be "
                               "an owner or admin.")
    def put(self, request):
        body = serializers.SpendLimitRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        organization = self.organization(request)
        services.update_limits(organization=organization, actor=_session_user(request) or _key_creator(request),
                               **body.validated_data)
        return self._answer(organization)
