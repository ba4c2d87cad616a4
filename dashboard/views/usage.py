"""Usage and cost: charts by day and by model, a table by API key, the latest requests, CSV export."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlencode

from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone

from .. import selectors
from ..forms import UsageRangeForm
from .common import organization_required

PRESETS = (("7", "7 days"), ("30", "30 days"), ("90", "90 days"))


@organization_required
def usage(request):
    today = timezone.now().date()
    form = UsageRangeForm(request.GET or None)
    start, end = form.period(today)
    if form.is_bound and not form.is_valid():
        start, end = today - timedelta(days=29), today
    data = selectors.usage_page(organization=request.organization, start=start, end=end)
    days = (end - start).days + 1
    presets = [{"days": value, "label": label, "active": end == today and days == int(value),
                "query": urlencode({"start": (today - timedelta(days=int(value) - 1)).isoformat(),
                                    "end": today.isoformat()})} for value, label in PRESETS]
    return render(request, "dashboard/usage.html", {
        **data, "form": form, "start": start, "end": end, "days": days, "presets": presets,
        "export_url": f"{reverse('billing-usage-export')}?{urlencode({'start': start.isoformat(), 'end': end.isoformat()})}",
    })
