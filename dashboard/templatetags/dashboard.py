"""Template helpers of the dashboard: money, counts, durations, and the interface's icons."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

from django import template
from django.utils.html import format_html
from django.utils.safestring import mark_safe

from ..selectors import humanize_count

register = template.Library()

# 20×20 line icons, drawn for this dashboard (stroke = currentColor).
_ICONS = {
    "home": '<path d="M3 9.5 10 4l7 5.5V16a1 1 0 0 1-1 1h-3.5v-4.5h-5V17H4a1 1 0 0 1-1-1z"/>',
    "catalog": '<rect x="3" y="3" width="6" height="6" rx="1.2"/><rect x="11" y="3" width="6" height="6" rx="1.2"/>'
               '<rect x="3" y="11" width="6" height="6" rx="1.2"/><rect x="11" y="11" width="6" height="6" rx="1.2"/>',
    "deployments": '<rect x="3" y="4" width="14" height="5" rx="1.2"/><rect x="3" y="11" width="14" height="5" rx="1.2"/>'
                   '<circle cx="6" cy="6.5" r=".6"/><circle cx="6" cy="13.5" r=".6"/><path d="M10 6.5h4M10 13.5h4"/>',
    "playground": '<path d="M4 5.5A1.5 1.5 0 0 1 5.5 4h9A1.5 1.5 0 0 1 16 5.5v6a1.5 1.5 0 0 1-1.5 1.5H9l-3.5 3v-3h0A1.5 1.5 0 0 1 4 11.5z"/>'
                  '<path d="M7.5 8.5h5"/>',
    "key": '<circle cx="7" cy="12" r="3.5"/><path d="m9.5 9.5 6-6M13.5 5.5l2 2M11.5 7.5l1.5 1.5"/>',
    "usage": '<path d="M3.5 16.5h13"/><path d="M5.5 14V10M9 14V6M12.5 14V8.5M16 14V4.5"/>',
    "billing": '<rect x="2.5" y="5" width="15" height="10.5" rx="1.5"/><path d="M2.5 8.5h15M5.5 12.5h3"/>',
    "members": '<circle cx="7.5" cy="7" r="2.7"/><path d="M2.8 16c.6-2.7 2.4-4.2 4.7-4.2s4.1 1.5 4.7 4.2"/>'
               '<circle cx="14" cy="7.8" r="2.1"/><path d="M13.6 11.9c1.9 0 3.2 1.2 3.7 3.4"/>',
    "fleet": '<rect x="3" y="3.5" width="14" height="4" rx="1"/><rect x="3" y="9.5" width="14" height="4" rx="1"/>'
             '<path d="M6 5.5h.01M6 11.5h.01M7 16.5h6M10 13.5v3"/>',
    "import": '<path d="M10 3v9M6.5 8.5 10 12l3.5-3.5"/><path d="M4 13.5V16h12v-2.5"/>',
    "plus": '<path d="M10 4.5v11M4.5 10h11"/>',
    "copy": '<rect x="7" y="7" width="9" height="9" rx="1.5"/><path d="M13 7V5.5A1.5 1.5 0 0 0 11.5 4h-6A1.5 1.5 0 0 0 4 5.5v6A1.5 1.5 0 0 0 5.5 13H7"/>',
    "check": '<path d="m4.5 10.5 3.5 3.5 7.5-8"/>',
    "arrow-right": '<path d="M4 10h12M11.5 5.5 16 10l-4.5 4.5"/>',
    "send": '<path d="M3.5 10 16.5 4l-4 12.5-2.8-5.2z"/><path d="m9.7 11.3 6.8-7.3"/>',
    "stop": '<rect x="5.5" y="5.5" width="9" height="9" rx="1.5"/>',
    "play": '<path d="M6.5 4.8v10.4l8.5-5.2z"/>',
    "logout": '<path d="M8 4H5a1 1 0 0 0-1 1v10a1 1 0 0 0 1 1h3"/><path d="M12 6.5 15.5 10 12 13.5M15.5 10H8"/>',
    "chevron": '<path d="m6 8 4 4 4-4"/>',
    "menu": '<path d="M3.5 6h13M3.5 10h13M3.5 14h13"/>',
    "spark": '<path d="M10 2.5v4M10 13.5v4M2.5 10h4M13.5 10h4M5 5l2.5 2.5M12.5 12.5 15 15M15 5l-2.5 2.5M7.5 12.5 5 15"/>',
    "download": '<path d="M10 3.5v9M6.5 9 10 12.5 13.5 9"/><path d="M4 15.5h12"/>',
    "trash": '<path d="M4.5 6h11M8 6V4.5h4V6M6 6l.7 10h6.6L14 6"/>',
    "settings": '<circle cx="10" cy="10" r="2.5"/><path d="M10 2.5v2.2M10 15.3v2.2M2.5 10h2.2M15.3 10h2.2M4.7 4.7l1.6 1.6M13.7 13.7l1.6 1.6M4.7 15.3l1.6-1.6M13.7 6.3l1.6-1.6"/>',
    "clock": '<circle cx="10" cy="10" r="7"/><path d="M10 6v4.2l2.8 1.8"/>',
    "bolt": '<path d="M11 2.5 4.5 11h5l-1 6.5L15.5 9h-5z"/>',
    "shield": '<path d="M10 2.8 16 5v4.6c0 3.6-2.5 6.3-6 7.6-3.5-1.3-6-4-6-7.6V5z"/>',
    "search": '<circle cx="9" cy="9" r="5.5"/><path d="m13 13 4 4"/>',
    "info": '<circle cx="10" cy="10" r="7"/><path d="M10 9v4.5M10 6.5h.01"/>',
    "logs": '<rect x="4" y="3" width="12" height="14" rx="1.5"/><path d="M7 7h6M7 10h6M7 13h4"/>',
    "batches": '<rect x="3" y="3" width="14" height="4" rx="1"/><rect x="3" y="8.5" width="14" height="4" rx="1"/>'
               '<path d="M3 15.5h14"/>',
}


@register.simple_tag
def icon(name: str, size: int = 18, css: str = "icon"):
    body = _ICONS.get(name, _ICONS["spark"])
    return format_html(
        '<svg class="{}" width="{}" height="{}" viewBox="0 0 20 20" fill="none" stroke="currentColor" '
        'stroke-width="1.6" stroke-linecap="round" stroke-linejoin="round" aria-hidden="true">{}</svg>',
        css, size, size, mark_safe(body),
    )


def _decimal(value) -> Decimal | None:
    if value is None or value == "":
        return None
    if isinstance(value, Decimal):
        return value
    if isinstance(value, float):  # never for money; tolerate display of a stray float exactly
        value = repr(value)
    try:
        return Decimal(str(value))
    except (InvalidOperation, ValueError):
        return None


_CENT = Decimal("0.01")
_MICRO = Decimal("0.000001")


@register.filter
def usd(value) -> str:
    """$1,234.50: a cent or more rounded to the cent; less shows as usd_exact does ($0.000040).
    Exact Decimal formatting, never through float."""
    amount = _decimal(value)
    if amount is None:
        return "—"
    if abs(amount) < _CENT:
        return usd_exact(amount)
    sign = "-" if amount < 0 else ""
    return f"{sign}${abs(amount).quantize(_CENT, rounding=ROUND_HALF_UP):,}"  # as billing rounds


@register.filter
def usd_exact(value) -> str:
    """To the micro-dollar. Below a cent, all six decimals ($0.000040, $0.000031), so that a
    column's small costs line up; zero and from a cent, trailing zeros trimmed past the cents
    ($0.00, $5.00, $0.125, $4.999958)."""
    amount = _decimal(value)
    if amount is None:
        return "—"
    amount = amount.quantize(_MICRO)
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    if 0 < amount < _CENT:
        return f"{sign}${amount:f}"
    whole, _, frac = format(amount, "f").rstrip("0").partition(".")
    return f"{sign}${int(whole):,}.{frac.ljust(2, '0')}"


@register.filter
def signed_usd(value) -> str:
    amount = _decimal(value)
    if amount is None:
        return "—"
    return ("+" if amount > 0 else "") + usd_exact(amount)


@register.filter
def status_label(value) -> str:
    """An API status for people: in_progress → In progress."""
    return str(value).replace("_", " ").capitalize()


@register.filter
def num(value) -> str:
    """1234567 → 1,234,567."""
    if value is None or value == "":
        return "—"
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError):
        return str(value)


@register.filter
def compact(value) -> str:
    """135000000 → 135M."""
    try:
        return humanize_count(int(value))
    except (TypeError, ValueError):
        return "—"


@register.filter
def ms(value) -> str:
    """Milliseconds for people: 45 ms, 1.23 s."""
    if value is None or value == "":
        return "—"
    value = int(value)
    if value < 1000:
        return f"{value} ms"
    return f"{value / 1000:.2f} s"


@register.filter
def duration_s(value) -> str:
    """Seconds for people: 42 s, 7 min, 3 h 12 min, 2 d 4 h."""
    try:
        seconds = int(value)
    except (TypeError, ValueError):
        return "—"
    if seconds < 60:
        return f"{seconds} s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 3600:
        return f"{minutes} min"
    if seconds < 86400:
        return f"{hours} h {minutes % 60} min"
    return f"{days} d {hours % 24} h"


@register.filter
def replica_hours(seconds) -> str:
    """Seconds of reserved replicas as replica-hours, "1.50 replica-hours", or under an hour as
    replica-minutes, "2.4 replica-minutes" (a few seconds are not "0.00 replica-hours")."""
    seconds = int(seconds or 0)
    if seconds < 3600:
        minutes = (Decimal(seconds) / 60).quantize(Decimal("0.1"))
        return f"{minutes} replica-minute{'' if minutes == 1 else 's'}"
    hours = (Decimal(seconds) / 3600).quantize(Decimal("0.01"))
    return f"{hours} replica-hour{'' if hours == 1 else 's'}"


HOURS_PER_MONTH = 730  # 365 × 24 / 12


@register.filter
def per_month(hourly) -> str:
    """An hourly price kept up a whole month (730 hours), in dollars: "$146.00"."""
    amount = _decimal(hourly)
    return "—" if amount is None else usd(amount * HOURS_PER_MONTH)


@register.filter
def per_mtok(value) -> str:
    """A per-million-token price: $0.05, $0.125, Free."""
    amount = _decimal(value)
    if amount is None:
        return "—"
    if amount == 0:
        return "Free"
    return usd_exact(amount)


@register.filter
def since(value) -> str:
    """"just now", "5 minutes ago", "2 days ago"."""
    from django.utils import timezone
    from django.utils.timesince import timesince

    if value is None:
        return "—"
    if (timezone.now() - value).total_seconds() < 60:
        return "just now"
    return f"{timesince(value).split(',')[0]} ago"


@register.filter
def get_item(mapping, key):
    try:
        return mapping.get(key)
    except AttributeError:
        return None
