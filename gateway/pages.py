"""OpenAI's cursor pages of a list whose items have ids: ``limit`` (1 to 100, 20 by default),
``order`` (``desc`` by default: newest first), ``after`` an item's id (the page after it) or
``before`` one (the page just before it); the page is
``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import invalid

MAX_LIMIT = 100


@dataclass(frozen=True)
class Page:
    limit: int = 20
    order: str = "desc"
    after: str | None = None
    before: str | None = None


def parse(query, *, default: int = 20, maximum: int = MAX_LIMIT) -> Page:
    """The page a query string asks for; 400 naming the parameter when it is wrong."""
    limit = query.get("limit", str(default))
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 6 and 1 <= int(limit) <= maximum):
        raise invalid("limit", f"limit must be an integer from 1 to {maximum}, not {limit[:40]!r}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"order must be asc or desc, not {order[:40]!r}")
    return Page(int(limit), order, query.get("after") or None, query.get("before") or None)


def parse_newest_first(query, *, default: int = 20, maximum: int = MAX_LIMIT) -> Page:
    """A page of a list that has no ``order`` parameter (OpenAI's batches): newest first."""
    return parse({key: query.get(key) for key in ("limit", "after") if query.get(key) is not None},
                 default=default, maximum=maximum)


def page(items: list[dict], wanted: Page) -> dict:
    ordered = items if wanted.order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = _position(ids, wanted.after, "after") + 1 if wanted.after else 0
    end = _position(ids, wanted.before, "before") if wanted.before else len(ordered)
    if wanted.before and not wanted.after:  # the page just before the cursor
        start = max(start, end - wanted.limit)
    data = ordered[start:end][:wanted.limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + len(data) < end}


def _position(ids: list[str], item_id: str, param: str) -> int:
    try:
        return ids.index(item_id)
    except ValueError:
        raise invalid(param, f"{param}: no item with id {item_id[:80]!r} in this list") from None
