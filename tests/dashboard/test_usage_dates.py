"""The usage page's period: what it says about the days it covers and about dates it cannot use."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone


def _today():
    return timezone.now().date()


def test_a_one_day_period_says_one_day(ada, acme):
    today = _today().isoformat()
    page = ada.get(f"/usage/?start={today}&end={today}")
    assert page.context["days"] == 1
    assert "· 1 day</div>" in page.content.decode()


def test_a_future_start_without_an_end_is_refused_as_a_future_start(ada, acme):
    start = _today() + timedelta(days=7)
    page = ada.get(f"/usage/?start={start.isoformat()}")
    html = page.content.decode()
    assert page.status_code == 200 and page.context["form"].errors.get("start")
    assert "after today" in html and "before the start date" not in html
    assert page.context["days"] == 30  # the default period instead


def test_a_start_alone_runs_to_today(ada, acme):
    start = _today() - timedelta(days=9)
    page = ada.get(f"/usage/?start={start.isoformat()}")
    assert not page.context["form"].errors
    assert (page.context["start"], page.context["end"], page.context["days"]) == (start, _today(), 10)


def test_invalid_dates_say_which_date_is_wrong(ada, acme):
    html = ada.get("/usage/?start=2026-02-30&end=soon").content.decode()
    assert "Enter the start date as YYYY-MM-DD." in html and "Enter the end date as YYYY-MM-DD." in html
    assert 'id="id_start" value="' in html and 'aria-invalid="true"' in html
