"""A deployment's page: a refused settings save is visible and leaves no broken address, the deploy
form opens its Advanced section on an error there, the figure cards refresh with the charts, times
are UTC and labelled, money in metrics.json has the platform's precision, a failed or stopped
deployment can be brought back and a serving one stopped, a saved settings change says whether the model reloads, and the
status poll keeps the reason line under the title current."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from billing.pricing import COST_QUANTUM
from dashboard.forms import DeploymentSettingsForm
from models_catalog.models import Deployment
from models_catalog.services import ENGINE_SETTINGS, SETTINGS, create_deployment, set_deployment_status
from tests.dashboard.conftest import record
from tests.dashboard.test_deployments import FORM
from tests.support import REPO_ROOT


@pytest.fixture
def tune_me(acme, catalog):
    model, _ = catalog
    return create_deployment(organization=acme[1], model=model, name="tune-me", created_by=acme[0])


def test_a_deployment_that_keeps_replicas_up_never_scales_to_zero_and_says_so(ada, tune_me):
    tune_me.kind, tune_me.scale_to_zero_seconds = "serverless", 300
    for minimum, shown in ((0, "after 300 s"), (1, "Never: keeps 1 up")):
        tune_me.min_replicas = minimum
        tune_me.save()
        assert shown in ada.get(f"/deployments/{tune_me.name}/").content.decode()


# --- a refused settings save -------------------------------------------------------------------------


@pytest.mark.parametrize("changes, label", [
    ({"max_batch_size": "0"}, "Max batch size"),
    ({"min_replicas": "3", "max_replicas": "2"}, "Max replicas"),
])
def test_a_refused_save_says_so_at_the_top_and_in_the_settings(ada, tune_me, changes, label):
    response = ada.post("/deployments/tune-me/settings/", {**FORM, **changes})
    assert response.status_code == 400
    page = response.content.decode()
    # A banner before the page's head, pointing at the settings...
    banner = page.index('id="settings-not-saved"')
    assert banner < page.index('class="page-head"') and 'href="#settings"' in page[banner:page.index('class="page-head"')]
    # ...and the field's error summed up at the top of the settings card, where the form lands.
    summary = page[page.index('id="settings"'):]
    assert 'id="settings-errors"' in summary and label in summary.split("</ul>")[0]
    assert 'action="/deployments/tune-me/settings/#settings"' in page
    assert Deployment.objects.get(name="tune-me").max_batch_size == 32


def test_after_a_refused_save_the_window_links_and_the_address_lead_to_the_page(ada, tune_me):
    page = ada.post("/deployments/tune-me/settings/", {**FORM, "max_batch_size": "0"}).content.decode()
    assert 'href="?window=' not in page
    for window in ("1h", "24h", "7d"):
        assert f'href="/deployments/tune-me/?window={window}"' in page
        assert ada.get(f"/deployments/tune-me/?window={window}").status_code == 200
    # The address bar goes back to the page, so a reload is a GET, not the POST again.
    assert 'history.replaceState(null, "", "/deployments/tune-me/#settings")' in page


def test_a_saved_or_plain_page_does_not_rewrite_the_address(ada, tune_me):
    page = ada.get("/deployments/tune-me/").content.decode()
    assert "replaceState" not in page and 'id="settings-not-saved"' not in page and 'id="settings-errors"' not in page


# --- the deploy form's Advanced section --------------------------------------------------------------


def test_an_error_in_advanced_opens_it_and_is_summed_up_at_the_top(ada, catalog):
    response = ada.post("/deploy/", {**FORM, "queue_limit": "0"})
    assert response.status_code == 200 and not Deployment.objects.filter(name=FORM["name"]).exists()
    page = response.content.decode()
    assert '<details class="card" id="advanced" open>' in page
    summary = page[page.index('id="error-summary"'):page.index('id="advanced"')]
    assert 'href="#id_queue_limit">Queue limit</a>' in summary


def test_advanced_stays_closed_when_its_fields_are_fine(ada, catalog):
    page = ada.post("/deploy/", {**FORM, "name": "Not Valid!"}).content.decode()
    assert '<details class="card" id="advanced">' in page
    assert 'href="#id_name">Deployment name</a>' in page


# --- the figure cards refresh with the charts --------------------------------------------------------


def test_metrics_json_carries_the_cards_and_the_latest_requests_as_rendered(ada, acme, tune_me):
    _, org = acme
    first = record(org, tune_me, request_id="chatcmpl-first")
    data = ada.get("/deployments/tune-me/metrics.json?window=1h").json()
    assert data["totals"]["requests"] == 1 and datetime.fromisoformat(data["as_of"])
    assert 'id="m-requests">1<' in data["html"]["figures"]
    assert f'data-request="{first.request_id}"' in data["html"]["recent"]
    # The page renders the same cards on its first load.
    page = ada.get("/deployments/tune-me/").content.decode()
    assert 'id="m-requests">1<' in page and 'id="metrics-as-of"' in page

    record(org, tune_me, request_id="chatcmpl-second")
    later = ada.get("/deployments/tune-me/metrics.json?window=1h").json()
    assert 'id="m-requests">2<' in later["html"]["figures"]
    assert 'data-request="chatcmpl-second"' in later["html"]["recent"]


def test_the_refreshed_cards_are_the_windows(ada, acme, tune_me):
    _, org = acme
    record(org, tune_me, finished_at=datetime.now(timezone.utc) - timedelta(hours=3))
    assert 'id="m-requests">0<' in ada.get("/deployments/tune-me/metrics.json?window=1h").json()["html"]["figures"]
    day = ada.get("/deployments/tune-me/metrics.json?window=24h").json()["html"]["figures"]
    assert 'id="m-requests">1<' in day and "in the last 24h" in day


# --- times and money ---------------------------------------------------------------------------------


def test_the_page_labels_its_times_utc(ada, acme, tune_me):
    record(acme[1], tune_me, finished_at=datetime.now(timezone.utc).replace(hour=23, minute=45, second=6)
           - timedelta(days=1))
    page = ada.get("/deployments/tune-me/").content.decode()
    assert "Times are UTC" in page and "<th>When (UTC)</th>" in page
    assert ", 23:45:06</td>" in page


def test_metrics_json_money_has_the_platforms_precision(ada, acme, tune_me):
    assert ada.get("/deployments/tune-me/metrics.json").json()["totals"]["cost"] == "0.000000"
    records = [record(acme[1], tune_me, prompt_tokens=123, completion_tokens=7) for _ in range(3)]
    cost = ada.get("/deployments/tune-me/metrics.json").json()["totals"]["cost"]
    assert cost == str(sum((r.cost for r in records), Decimal(0)).quantize(COST_QUANTUM))
    assert len(cost.split(".")[1]) == 6


# --- charts.js: chart labels in UTC ------------------------------------------------------------------

_LABELS = """
global.window = {};
require(%s);
const C = window.DashboardCharts;
console.log(JSON.stringify([C.timeLabel("2024-03-10T23:30:00+00:00", 60),
  C.timeLabel("2024-03-10T00:00:00+00:00", 3600), C.clock("2024-03-10T23:30:05+00:00")]));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the dashboard's script")
@pytest.mark.parametrize("zone", ["America/Los_Angeles", "Asia/Kolkata"])
def test_chart_labels_are_utc_whatever_the_browsers_zone(zone):
    script = _LABELS % json.dumps(str(REPO_ROOT / "static" / "js" / "charts.js"))
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True,
                         env={"TZ": zone, "LANG": "en_US.UTF-8", "PATH": "/usr/bin:/bin:/usr/local/bin"})
    minute, hour, clock = json.loads(out.stdout)
    assert minute == "23:30" and clock == "23:30:05"
    assert hour.startswith("Mar 10") and hour.endswith("00:00")


# --- the status poll carries the reason line -------------------------------------------------------

REASON = '<span id="deployment-reason"{}>{}</span>'


def test_the_status_poll_updates_the_reason_line_under_the_title_too(ada, tune_me):
    set_deployment_status(deployment=tune_me, status="scaled_to_zero", reason="idle for 20s")
    page = ada.get("/deployments/tune-me/").content.decode()
    assert REASON.format("", ' · <span class="muted">idle for 20s</span>') in page
    assert 'hx-get="/deployments/tune-me/status/"' in page and "hx-swap-oob" not in page

    # A cold start: the poll answers the badge, and the reason line out of band.
    set_deployment_status(deployment=tune_me, status="loading", reason="loading on gpu-1 <a>")
    poll = ada.get("/deployments/tune-me/status/", headers={"HX-Request": "true"}).content.decode()
    assert 'data-status="loading"' in poll and 'id="deployment-status"' in poll
    assert REASON.format(' hx-swap-oob="true"', ' · <span class="muted">loading on gpu-1 &lt;a&gt;</span>') in poll
    # Ready, with no reason: the stale one is cleared, not kept.
    set_deployment_status(deployment=tune_me, status="ready", reason="")
    poll = ada.get("/deployments/tune-me/status/", headers={"HX-Request": "true"}).content.decode()
    assert 'data-status="ready"' in poll and REASON.format(' hx-swap-oob="true"', "") in poll
    assert "idle for" not in poll


# --- a failed or stopped deployment comes back from its page ----------------------------------------


def _status(name: str) -> tuple[str, str]:
    deployment = Deployment.objects.get(name=name)
    return deployment.status, deployment.status_reason


@pytest.mark.parametrize("status, label", [("failed", "Retry"), ("stopped", "Start")])
def test_a_failed_or_stopped_deployment_offers_to_bring_it_back(ada, tune_me, status, label):
    set_deployment_status(deployment=tune_me, status=status, reason="out of memory")
    page = ada.get("/deployments/tune-me/").content.decode()
    form = page[page.index('id="start-form"'):].split("</form>")[0]
    assert 'action="/deployments/tune-me/start/"' in page and f"{label}</button>" in form

    response = ada.post("/deployments/tune-me/start/", follow=True)
    assert response.redirect_chain == [("/deployments/tune-me/", 302)]
    assert _status("tune-me")[0] == "pending"
    assert "requests wait until it is ready" in response.content.decode()
    assert 'id="start-form"' not in response.content.decode()  # nothing left to start


@pytest.mark.parametrize("status", ["pending", "loading", "ready", "scaled_to_zero"])
def test_a_serving_deployment_has_nothing_to_start(ada, tune_me, status):
    set_deployment_status(deployment=tune_me, status=status, reason="as it was")
    assert 'id="start-form"' not in ada.get("/deployments/tune-me/").content.decode()
    # A start sent from a page that was out of date changes nothing.
    page = ada.post("/deployments/tune-me/start/", follow=True).content.decode()
    assert _status("tune-me") == (status, "as it was") and "nothing to start" in page


@pytest.mark.parametrize("status", ["pending", "loading", "ready", "scaled_to_zero"])
def test_a_serving_deployment_can_be_stopped_and_started_again_from_its_page(ada, tune_me, status):
    set_deployment_status(deployment=tune_me, status=status, reason="as it was")
    page = ada.get("/deployments/tune-me/").content.decode()
    assert 'id="stop-button"' in page and 'action="/deployments/tune-me/stop/"' in page

    response = ada.post("/deployments/tune-me/stop/", follow=True)
    assert response.redirect_chain == [("/deployments/tune-me/", 302)]
    assert _status("tune-me") == ("stopped", "stopped from the dashboard")
    page = response.content.decode()
    assert "is stopping" in page and 'id="start-form"' in page and 'id="stop-button"' not in page
    # A stop sent from a page that was out of date keeps the first stop's reason.
    page = ada.post("/deployments/tune-me/stop/", follow=True).content.decode()
    assert "stopped already" in page and _status("tune-me") == ("stopped", "stopped from the dashboard")


def test_the_status_poll_swaps_start_and_stop_as_the_status_changes(ada, tune_me):
    """The API or the placement loop may change the status while the page is open: the button
    follows the badge, without a reload."""
    set_deployment_status(deployment=tune_me, status="failed", reason="out of memory")
    poll = ada.get("/deployments/tune-me/status/", headers={"HX-Request": "true"}).content.decode()
    lifecycle = poll[poll.index('id="deployment-lifecycle"'):]
    assert lifecycle.startswith('id="deployment-lifecycle" hx-swap-oob="true"')
    assert 'id="start-form"' in lifecycle and "Retry</button>" in lifecycle and "stop-button" not in lifecycle
    set_deployment_status(deployment=tune_me, status="ready", reason="")
    poll = ada.get("/deployments/tune-me/status/", headers={"HX-Request": "true"}).content.decode()
    assert 'id="stop-button"' in poll and 'id="start-form"' not in poll


def test_the_retry_says_where_it_came_from(ada, tune_me):
    set_deployment_status(deployment=tune_me, status="failed", reason="out of memory")
    ada.post("/deployments/tune-me/start/")
    assert _status("tune-me") == ("pending", "tried again from the dashboard")
    set_deployment_status(deployment=tune_me, status="stopped", reason="stopped through the API")
    ada.post("/deployments/tune-me/start/")
    assert _status("tune-me") == ("pending", "started from the dashboard")


def test_saving_a_failed_deployments_settings_tries_it_again_as_the_apis_patch_does(ada, tune_me):
    set_deployment_status(deployment=tune_me, status="failed", reason="out of memory")
    response = ada.post("/deployments/tune-me/settings/", {**FORM, "max_batch_size": "4"})
    assert response.status_code == 302
    status, reason = _status("tune-me")
    assert status == "pending" and "trying again" in reason
    # A stopped one stays stopped: its page's Start brings it back.
    set_deployment_status(deployment=tune_me, status="stopped", reason="stopped through the API")
    ada.post("/deployments/tune-me/settings/", {**FORM, "max_batch_size": "8"})
    assert _status("tune-me") == ("stopped", "stopped through the API")


def test_a_refused_save_leaves_a_failed_deployment_failed(ada, tune_me):
    set_deployment_status(deployment=tune_me, status="failed", reason="out of memory")
    assert ada.post("/deployments/tune-me/settings/", {**FORM, "max_batch_size": "0"}).status_code == 400
    assert _status("tune-me") == ("failed", "out of memory")


# --- what a saved settings change says ---------------------------------------------------------------

LOADING = "Settings saved. Workers are loading the model with them; requests wait until it is ready."


def _save(client, name: str, **changes) -> str:
    """Saves the deployment's settings as its page's form shows them, with ``changes``; the message."""
    initial = DeploymentSettingsForm.initial_for(Deployment.objects.get(name=name))
    data = {field: ("on" if value else "") if isinstance(value, bool) else str(value)
            for field, value in {**initial, **changes}.items()}
    response = client.post(f"/deployments/{name}/settings/", data, follow=True)
    assert response.redirect_chain == [(f"/deployments/{name}/", 302)]
    page = response.content.decode()
    return page.split('<ul class="messages" role="status">')[1].split("</ul>")[0].split(">", 1)[1].split("</li>")[0]


@pytest.mark.parametrize("changes", [{"batch_window_ms": 50}, {"max_batch_size": 4}, {"dtype": "float16"},
                                     {"quantization": "fp8"}])
def test_an_engine_setting_reloads_the_model_and_the_message_says_so(ada, tune_me, changes):
    set_deployment_status(deployment=tune_me, status="ready")
    assert _save(ada, "tune-me", **changes) == LOADING


@pytest.mark.parametrize("changes", [{}, {"queue_limit": 10}, {"scale_to_zero_seconds": 60},
                                     {"scale_to_zero": False}, {"min_replicas": 1, "max_replicas": 2}])
def test_other_settings_apply_without_a_reload_and_the_message_says_only_saved(ada, tune_me, changes):
    set_deployment_status(deployment=tune_me, status="ready")
    assert _save(ada, "tune-me", **changes) == "Settings saved."


def test_a_deployment_without_a_loaded_model_says_when_it_loads_with_them(ada, tune_me):
    set_deployment_status(deployment=tune_me, status="scaled_to_zero", reason="idle for 300s")
    assert _save(ada, "tune-me", max_batch_size=4) == \
        "Settings saved. It is scaled to zero: the next request loads the model with them."
    set_deployment_status(deployment=tune_me, status="stopped", reason="stopped through the API")
    assert _save(ada, "tune-me", max_batch_size=8) == \
        "Settings saved. The model loads with them when the deployment is started."
    # A failed one is tried again, whatever changed: it loads now.
    set_deployment_status(deployment=tune_me, status="failed", reason="out of memory")
    assert _save(ada, "tune-me", queue_limit=10) == LOADING


def test_the_settings_hint_names_the_fields_that_reload_the_model(ada, tune_me):
    page = ada.get("/deployments/tune-me/").content.decode()
    hint = page.split('id="settings-hint">')[1].split("</p>")[0]
    assert hint.startswith("Changing Batch window (ms), Max batch size, Precision or Weights reloads the model")
    assert "The other settings apply without a reload." in hint


def test_the_settings_that_reload_are_those_the_workers_engine_is_built_with(tune_me):
    """The message's rule (ENGINE_SETTINGS) and the placement loop's (a replica whose engine spec
    differs is replaced) name the same settings."""
    from workers.dispatch import engine_spec

    assert set(engine_spec(tune_me)) & SETTINGS == ENGINE_SETTINGS
