"""A new user's whole journey through the dashboard in Chromium, against the real stack: sign up,
create an API key, deploy the bundled model, chat in the playground (and stop a reply), top up
with a test card through localstripe's Stripe.js, read the usage page, revoke the key. Then: a
second organization sees none of it; and the operator's pages."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from decimal import Decimal

import httpx
import pytest

from tests.browser.conftest import PASSWORD, confirm_email, shot, sign_up, unique
from tests.e2e.conftest import DEPLOYMENT
from tests.support import wait_until

pytestmark = pytest.mark.slow

HOME = re.compile(r"^https?://[^/]+/$")
LAPTOP = {"width": 1280, "height": 800}
DESKTOP = {"width": 1440, "height": 900}  # new_page's
KEY_NAME = "journey key for the nightly analytics backend"  # long: shortened in the keys table, wrapped elsewhere


def _chat(base: str, key: str, model: str):
    return httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})


def _set_range(page, selector: str, value: str) -> None:
    page.eval_on_selector(selector, "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", value)


def _fits_a_laptop(page, table: str) -> bool:
    """Whether ``table`` fits its card on a 1280 px laptop: its box has nothing to scroll sideways,
    no column is cut off."""
    page.set_viewport_size(LAPTOP)
    try:
        return page.eval_on_selector(table, "t => t.parentElement.scrollWidth <= t.parentElement.clientWidth")
    finally:
        page.set_viewport_size(DESKTOP)


def _chat_at_end(page) -> bool:
    return page.evaluate("() => { const pane = document.getElementById('messages');"
                         " return pane.scrollHeight - pane.scrollTop - pane.clientHeight < 2; }")


def _serve(worker: str, deployment: str) -> None:
    """What the fleet's placement does for a new deployment: the worker consumes its queue."""
    from inference_platform.celery import app, deployment_queue

    replies = app.control.add_consumer(deployment_queue(deployment), destination=[worker], reply=True, timeout=10)
    assert replies and "ok" in next(iter(replies[0].values())), replies


def test_a_new_user_deploys_chats_pays_and_revokes(new_page, stack, inference_worker, db_call):
    page = new_page()

    # --- sign up -------------------------------------------------------------------------------------
    page.goto("/signup/")
    shot(page, "01-signup")
    account = sign_up(page, name="Ada Lovelace", organization=unique("Analytical"), confirm=False)
    assert HOME.match(page.url)
    assert page.locator(".org-switcher").inner_text().startswith(account.organization[:1])
    assert "$5.00 sign-up credit" in page.locator("#email-unconfirmed").inner_text()
    assert page.locator("#overview-balance").inner_text() == "$0.00"  # until the address is confirmed
    shot(page, "02-overview-email-unconfirmed")
    confirm_email(page, account.email)
    assert page.locator("#email-unconfirmed").count() == 0
    assert page.locator("#overview-balance").inner_text() == "$5.00"  # the sign-up credit
    shot(page, "02-overview-new-user")

    # --- an API key, shown once ------------------------------------------------------------------------
    page.click("nav >> text=API keys")
    page.click("#create-key-button")
    page.fill("#create-key-dialog #id_name", KEY_NAME)
    page.check("#create-key-dialog input[value=read_usage]")
    shot(page, "03-api-key-create-dialog")
    page.click("#create-key-submit")
    secret = page.locator("#new-key-secret").inner_text().strip()
    assert secret.startswith("sk-")
    page.click("#copy-new-key")
    page.wait_for_selector("#copy-new-key.copied")
    shot(page, "04-api-key-created")
    assert _fits_a_laptop(page, "#api-keys-table")  # its Revoke button is not cut off
    page.reload()
    assert page.locator("#new-key-secret").count() == 0 and secret not in page.content()

    # --- the catalog, then deploy the bundled model ----------------------------------------------------------
    page.click("nav >> text=Models")
    page.fill("input[name=search]", "smol")
    page.wait_for_url(re.compile(r"search=smol"))
    page.wait_for_selector(f"[data-model={DEPLOYMENT}]")
    shot(page, "05-catalog")
    page.click(f"[data-model={DEPLOYMENT}]")
    assert f"{stack}/v1/chat/completions" in page.inner_text("#model-examples pre[data-panel=curl]")
    page.click("#model-examples button[data-tab=python]")
    assert f'base_url="{stack}/v1"' in page.inner_text("#model-examples pre[data-panel=python]")
    shot(page, "06-model-page")

    name = unique("journey-smollm2-135m-instruct").lower()  # as long as real names get
    page.click("text=Deploy this model")
    assert page.input_value("#id_name")  # a name is suggested
    page.fill("#id_name", name)
    page.fill("#id_batch_window_ms", "10")
    page.fill("#id_max_batch_size", "8")
    page.fill("#id_max_replicas", "2")
    shot(page, "07-deploy-form")
    page.click("#deploy-form button[type=submit]")
    page.wait_for_url(f"**/deployments/{name}/")

    # The list shows it pending; once a worker serves it, "Ready" appears without a reload.
    page.click("nav >> text=Deployments")
    row = page.locator(f"#own-deployments tr[data-deployment='{name}']")
    assert row.locator("[data-status]").get_attribute("data-status") == "pending"
    page.evaluate("window.__notReloaded = true")
    _serve(inference_worker, name)

    def moved_to(status, reason=""):
        from models_catalog.models import Deployment
        from models_catalog.services import set_deployment_status

        set_deployment_status(deployment=Deployment.objects.get(name=name), status=status, reason=reason)

    # The fleet's own moves are the fleet tests' (tests/workers/test_fleet.py); here, that the
    # page follows them: loading, then ready.
    for status in ("loading", "ready"):
        db_call(lambda: moved_to(status))
        page.wait_for_selector(f"#own-deployments tr[data-deployment='{name}'] [data-status={status}]",
                               timeout=15_000)
    assert page.evaluate("window.__notReloaded") is True
    shot(page, "08-deployments")

    # --- the playground: a streamed reply with its tokens and cost, then a stopped one --------------------
    page.goto(f"/playground/?deployment={name}")
    page.wait_for_selector("#conn-state[data-state=open]")
    _set_range(page, "#p-temperature", "0")
    page.fill("#p-max-tokens", "24")
    page.fill("#chat-input", "Write a haiku about GPUs.")
    page.keyboard.press("Enter")
    first = page.locator(".msg.assistant").nth(0)
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=120_000)
    assert first.locator(".text").inner_text().strip()
    page.wait_for_selector(".msg.assistant [data-cost][data-source=billed]", timeout=30_000)
    billed_cost = Decimal(first.locator("[data-cost]").get_attribute("data-cost"))
    assert billed_cost > 0
    shown = first.locator("[data-cost]").inner_text()
    assert re.fullmatch(r"\$0\.\d{6}", shown), shown  # under a cent: all six decimals, as the usage page writes it
    assert int(first.locator("[data-tokens]").get_attribute("data-tokens")) > 0

    # On a laptop, where this long a question fills the chat: it has to scroll to show the reply's chips.
    # Without scroll anchoring (Safari has none; Chromium's follows the end in some layouts only), the
    # page alone keeps them in view.
    page.set_viewport_size(LAPTOP)
    page.add_style_tag(content="#messages { overflow-anchor: none; }")
    page.fill("#p-max-tokens", "1500")
    page.fill("#chat-input", "Tell me a very long story about a brave little robot who explores the ocean.\nIn it:\n"
              + "".join(f"- {part}\n" for part in ("the robot's name", "a storm", "a whale who helps", "a sunken ship",
                                                   "a map to a hidden reef", "a friend", "the way home")))
    page.click("#send-button")
    second = page.locator(".msg.assistant").nth(1)
    page.wait_for_function("() => (document.querySelectorAll('.msg.assistant')[1]?.querySelector('.text')"
                           "?.textContent.length || 0) > 12", timeout=120_000)
    page.click("#stop-button")
    page.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=30_000)
    assert second.locator("[data-stopped]").count() == 1
    stopped_id = second.get_attribute("data-api-request-id")

    def stopped_record():
        from billing.models import UsageRecord

        return UsageRecord.objects.filter(request_id=stopped_id).first()

    record = wait_until(lambda: db_call(stopped_record), timeout=30, message="the stopped reply's usage record")
    assert record.status == "cancelled" and 0 < record.completion_tokens < 1500
    page.wait_for_selector(".msg.assistant[data-state=stopped] [data-cost][data-source=billed]", timeout=30_000)
    assert page.evaluate("() => { const pane = document.getElementById('messages');"
                         " return pane.scrollHeight > pane.clientHeight; }")  # it scrolls
    assert _chat_at_end(page), "the stopped reply's chips are below the fold"

    shot(page, "09-playground")
    page.set_viewport_size(DESKTOP)

    # JSON output, in a new conversation: the reply is a JSON object.
    page.goto(f"/playground/?deployment={name}")
    page.wait_for_selector("#conn-state[data-state=open]")
    _set_range(page, "#p-temperature", "0")
    page.fill("#p-max-tokens", "200")
    page.check("#p-json")
    page.fill("#chat-input", "Describe a cat as JSON with its name, age and colour.")  # greedy, it ends in 29 tokens
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=120_000)
    reply = page.locator(".msg.assistant").nth(0).locator(".text").inner_text()
    assert isinstance(json.loads(reply), dict), reply
    assert page.locator(".msg.assistant [data-cut]").count() == 0  # it ended on its own, not at Max tokens
    shot(page, "09b-playground-json")
    page.uncheck("#p-json")

    # A parameter the API would refuse, or the page would have to change, is shown next to its field
    # and nothing is sent; the message stays in the composer.
    page.click("#clear-button")
    assert page.locator("#chat-empty").is_visible()
    page.fill("#p-seed", "1.5")
    page.fill("#chat-input", "Invent a name for a cat.")
    page.keyboard.press("Enter")
    assert page.is_visible("#p-seed-error") and page.get_attribute("#p-seed", "aria-invalid") == "true"
    assert page.locator(".msg").count() == 0 and page.input_value("#chat-input") == "Invent a name for a cat."

    # The parameters panel reaches the engine: the same seed samples the same reply.
    _set_range(page, "#p-temperature", "1")
    _set_range(page, "#p-top-p", "0.9")
    page.fill("#p-seed", "1234")
    page.fill("#p-max-tokens", "12")
    seeded = []
    for _ in range(2):
        page.click("#clear-button")
        page.fill("#chat-input", "Invent a name for a cat.")
        page.click("#send-button")
        page.wait_for_selector(".msg.assistant[data-state=done] [data-cost][data-source=billed]", timeout=120_000)
        seeded.append(page.locator(".msg.assistant .text").inner_text().strip())
    assert seeded[0] and seeded[0] == seeded[1], seeded

    # --- the key works against the new deployment --------------------------------------------------------
    response = _chat(stack, secret, name)
    assert response.status_code == 200, response.text
    api_request = response.json()["id"]

    def api_record():
        from billing.models import UsageRecord

        return UsageRecord.objects.filter(request_id=api_request).exists()

    wait_until(lambda: db_call(api_record), timeout=30, message="the API call's usage record")

    # --- top up with a test card through localstripe's Stripe.js ------------------------------------------
    page.click("nav >> text=Billing")
    before = Decimal(page.get_attribute("#billing-balance", "data-balance"))
    assert before < Decimal("5")  # the replies were charged
    page.click("button[data-amount='10.00']")
    card = "#card-element input"
    page.wait_for_selector(f"{card}[placeholder=number]")
    page.fill(f"{card}[placeholder=number]", "4242424242424242")
    page.fill(f"{card}[placeholder=exp_month]", "12")
    page.fill(f"{card}[placeholder=exp_year]", "34")
    page.fill(f"{card}[placeholder=cvc]", "123")
    page.fill(f"{card}[placeholder=postal_code]", "75001")
    shot(page, "10-billing-card")
    page.click("#topup-submit")
    page.wait_for_selector("#topup-status:has-text('added to your credit')", timeout=60_000)
    page.wait_for_load_state("load")
    page.wait_for_selector("#ledger tr[data-kind=topup]")
    assert Decimal(page.get_attribute("#billing-balance", "data-balance")) == before + Decimal("10")
    assert page.locator("#ledger tr[data-kind=topup]").count() == 1

    def topups():
        from billing.models import LedgerEntry, TopUp

        entries = LedgerEntry.objects.filter(organization__name=account.organization, kind="topup")
        return [str(e.amount) for e in entries], list(TopUp.objects.filter(
            organization__name=account.organization).values_list("status", flat=True))

    assert db_call(topups) == (["10.000000"], ["succeeded"])
    page.fill("#balance-alert-amount", "2.50")  # an email to the owner when the credit runs low
    page.click("#balance-alert-form button[value=save]")
    page.wait_for_selector("text=The low-balance alert is now $2.50.")
    assert page.input_value("#balance-alert-amount") == "2.50" and page.locator("#balance-alert-remove").count() == 1
    shot(page, "11-billing")
    # On a laptop the history spans the page: a charge's description (model on deployment) keeps to one line.
    page.set_viewport_size(LAPTOP)
    lines = page.eval_on_selector("#ledger tr[data-kind=usage] td:nth-child(3)", """cell => {
        const text = document.createRange();
        text.selectNodeContents(cell);
        return new Set([...text.getClientRects()].map((line) => Math.round(line.top))).size; }""")
    page.set_viewport_size(DESKTOP)
    assert lines == 1, f"a charge's description takes {lines} lines at 1280 px"

    # --- usage: the requests with their tokens and cost --------------------------------------------------
    page.click("nav >> text=Usage")
    rows = page.locator("#usage-requests tbody tr")
    assert rows.count() == 6  # the haiku, the stopped story, the JSON reply, two seeded ones, the API call
    for request_id in (stopped_id, api_request):
        row = page.locator(f"#usage-requests tr[data-request='{request_id}']")
        assert int(row.locator("[data-completion-tokens]").get_attribute("data-completion-tokens")) > 0
        assert Decimal(row.locator("[data-cost]").get_attribute("data-cost")) > 0
    assert "/v1/ws" in page.inner_text(f"#usage-requests tr[data-request='{stopped_id}']")  # the playground's socket
    assert "/v1/ws" in page.inner_text("#usage-by-endpoint")
    by_key = page.inner_text("#usage-by-key")
    assert KEY_NAME in by_key and "Playground" in by_key
    assert page.get_attribute("#csv-export", "href").startswith("/v1/usage/export.csv?start=")
    page.wait_for_timeout(400)  # the charts' entry animation (250 ms), for the screenshot only
    shot(page, "12-usage")
    assert _fits_a_laptop(page, "#usage-requests")  # its Cost and Status columns are not cut off

    page.goto(f"/deployments/{name}/")
    assert page.inner_text("#m-requests") == "6"
    page.wait_for_timeout(400)
    shot(page, "13-deployment")
    # Its status poll follows a reload without a page load: the badge, and the reason line under the
    # title, which an empty reason clears.
    page.evaluate("window.__notReloaded = true")
    for status, reason in (("loading", "loading on the journey's worker"), ("ready", "")):
        db_call(lambda: moved_to(status, reason))
        page.wait_for_selector(f"#deployment-status [data-status={status}]", timeout=15_000)
        page.wait_for_function("r => document.getElementById('deployment-reason').textContent === r",
                               arg=f" · {reason}" if reason else "", timeout=5_000)
    assert page.evaluate("window.__notReloaded") is True
    # On a laptop, the code tabs leave room for their Copy button on their line, and the Weights
    # options show whole in their half-width select.
    page.set_viewport_size(LAPTOP)
    assert page.eval_on_selector("#deployment-examples .tabbar", """bar => bar.querySelector(".copy-btn")
        .getBoundingClientRect().top < bar.querySelector(".tab").getBoundingClientRect().bottom""")
    clipped = page.eval_on_selector("#id_quantization", """select => {
        const style = getComputedStyle(select), text = document.createElement("canvas").getContext("2d");
        text.font = style.font;
        const room = select.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
        return [...select.options].map((o) => o.text).filter((label) => text.measureText(label).width > room); }""")
    assert not clipped, clipped
    page.set_viewport_size(DESKTOP)

    # --- a Responses API call is stored: the logs list it, with its conversation ---------------------------
    stored = httpx.post(f"{stack}/v1/responses", headers={"Authorization": f"Bearer {secret}"}, timeout=120,
                        json={"model": name, "input": "Say hi to the logs.", "max_output_tokens": 8})
    assert stored.status_code == 200, stored.text
    response_id = stored.json()["id"]
    page.click("nav >> text=Logs")
    row = page.locator(f"tr[data-response='{response_id}']")
    assert "Say hi to the logs." in row.locator("[data-asked]").inner_text()
    shot(page, "13b-logs")
    row.locator("a").click()
    page.wait_for_selector("#input-items")
    assert "Say hi to the logs." in page.locator("#input-items").inner_text()
    answer = " ".join(stored.json()["output"][0]["content"][0]["text"].split())
    assert answer and answer in " ".join(page.locator("#output-items").inner_text().split())
    shot(page, "13c-response-detail")

    # --- a batch: its progress on the Batches page, its output to download -----------------------------------
    lines = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": name, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6}}) + "\n" for i in range(2))
    auth = {"Authorization": f"Bearer {secret}"}
    uploaded = httpx.post(f"{stack}/v1/files", headers=auth, data={"purpose": "batch"},
                          files={"file": ("in.jsonl", lines.encode())}, timeout=30)
    assert uploaded.status_code == 200, uploaded.text
    batch = httpx.post(f"{stack}/v1/batches", headers=auth, timeout=30, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    page.click("nav >> text=Batches")
    row = page.locator(f"tr[data-batch='{batch.json()['id']}']")
    row.locator("a[data-output]").wait_for(timeout=120_000)  # the page polls until the batch ends
    assert row.get_attribute("data-status") == "completed"
    assert row.locator("[data-progress]").get_attribute("data-progress") == "2/2"
    shot(page, "13d-batches")
    assert _fits_a_laptop(page, "#batches-table")

    # --- revoke the key: calls with it fail ---------------------------------------------------------------
    page.click("nav >> text=API keys")
    page.click(f"tr[data-key='{KEY_NAME}'] button:has-text('Revoke')")
    page.wait_for_selector(f"tr[data-key='{KEY_NAME}'] .badge-revoked")
    shot(page, "14-api-key-revoked")
    response = _chat(stack, secret, name)
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]

    # A phone-sized view of the overview.
    phone = new_page(width=390, height=844)
    phone.goto("/login/")
    phone.fill("#id_username", account.email)
    phone.fill("#id_password", PASSWORD)
    phone.click("button[type=submit]")
    phone.wait_for_url(HOME)
    shot(phone, "15-overview-phone")
    # The closed menu is out of the tab order; its button says whether it is open; Escape closes it.
    toggle = phone.locator("[data-nav-toggle]")
    phone.keyboard.press("Tab")
    assert phone.evaluate("() => document.activeElement.closest('.sidebar') === null")
    assert toggle.get_attribute("aria-expanded") == "false"
    toggle.click()
    assert toggle.get_attribute("aria-expanded") == "true"
    phone.keyboard.press("Escape")
    assert toggle.get_attribute("aria-expanded") == "false"
    assert phone.evaluate("() => document.activeElement.hasAttribute('data-nav-toggle')")
    for path in ("/", "/models/", f"/deployments/{name}/", "/playground/", "/api-keys/", "/responses/",
                 f"/responses/{response_id}/", "/batches/", "/usage/", "/billing/"):
        phone.goto(path)
        width = phone.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} is {width} px wide on a 390 px phone"
    assert not page.js_errors and not phone.js_errors, page.js_errors + phone.js_errors


def test_another_organization_sees_none_of_it(new_page, stack, db_call):
    tag = unique("iso").lower()

    def first_organization():
        from accounts.services import create_api_key, create_organization, create_user
        from billing.services import record_usage
        from models_catalog.models import CatalogModel
        from models_catalog.services import create_deployment

        owner = create_user(email=f"{tag}@example.com", password=None)
        org = create_organization(name=f"First {tag}", owner=owner)
        deployment = create_deployment(organization=org, model=CatalogModel.objects.get(slug=DEPLOYMENT),
                                       name=f"{tag}-private")
        key, _ = create_api_key(organization=org, name=f"{tag}-key", scopes=["inference"])
        record = record_usage(event={
            "request_id": f"chatcmpl-{tag}", "organization_id": org.pk, "api_key_id": key.pk,
            "deployment_id": deployment.pk, "model": DEPLOYMENT, "deployment": deployment.name,
            "prompt_tokens": 10, "cached_prompt_tokens": 0, "completion_tokens": 20, "status": "completed",
            "queue_ms": 1, "ttft_ms": 5, "latency_ms": 50,
            "finished_at": datetime.now(timezone.utc).isoformat(),
        })
        return deployment.name, key.name, key.prefix, record.request_id

    deployment, key_name, prefix, request_id = db_call(first_organization)
    page = new_page()
    sign_up(page, name="Grace Hopper", organization=unique("Compilers"))
    for path in ("/", "/deployments/", "/api-keys/", "/responses/", "/batches/", "/usage/", "/playground/",
                 "/billing/"):
        page.goto(path)
        html = page.content()
        for secret in (deployment, key_name, prefix, request_id):
            assert secret not in html, (path, secret)
    assert page.goto(f"/deployments/{deployment}/").status == 404
    assert page.goto(f"/deployments/{deployment}/metrics.json").status == 404
    page.goto("/usage/")
    assert page.locator("#usage-requests").count() == 0 and "No requests in this period" in page.content()
    shot(page, "16-other-organization-usage")


def test_operator_pages_and_team_management(new_page, stack, inference_worker, db_call):
    email = f"{unique('operator')}@example.com"

    long_name = unique("smollm2-135m-instruct-production-eu-west")

    def operator():
        from accounts.services import create_organization, create_user
        from models_catalog.models import CatalogModel
        from models_catalog.services import create_deployment

        user = create_user(email=email, password=PASSWORD, name="Olive Operator")
        user.is_staff = True
        user.save(update_fields=["is_staff"])
        create_organization(name="Platform Ops", owner=user)
        # A customer's deployment whose names are long, for the fleet's table.
        customer = create_organization(name="Analytical Engines Research Laboratory",
                                       owner=create_user(email=f"{unique('customer')}@example.com", password=None))
        create_deployment(organization=customer, model=CatalogModel.objects.get(slug=DEPLOYMENT), name=long_name,
                          kind="dedicated", min_replicas=2, max_replicas=12)

    db_call(operator)
    page = new_page()
    page.goto("/login/?next=/operator/fleet/")
    page.fill("#id_username", email)
    page.fill("#id_password", "not the password")
    page.click("button[type=submit]")
    assert "don't match" in page.inner_text(".form-errors")
    page.fill("#id_password", PASSWORD)
    shot(page, "17-login")
    page.click("button[type=submit]")
    page.wait_for_url("**/operator/fleet/")
    page.wait_for_selector(f"#workers-table tr[data-worker='{inference_worker}']", timeout=20_000)
    assert DEPLOYMENT in page.inner_text(f"#workers-table tr[data-worker='{inference_worker}']")
    assert "Analytical Engines" in page.inner_text(f"#fleet-deployments tr[data-deployment='{long_name}']")
    shot(page, "18-fleet")
    for table in ("#workers-table", "#fleet-deployments"):  # the heartbeat and the status are not cut off
        assert _fits_a_laptop(page, table), table
    page.click("nav >> text=Import a model")
    page.fill("#id_path", "../etc/passwd")
    page.click("form.card button[type=submit]")
    assert "not allowed" in page.inner_text(".field.has-error")
    shot(page, "19-import")

    page.click("nav >> text=Members")
    page.fill("#id_email", "teammate@example.com")
    page.select_option("#id_role", "admin")
    page.click("main aside button[type=submit]")
    page.wait_for_selector("#invitations-table tr[data-invitation='teammate@example.com']")
    shot(page, "20-members")
    # A role changes with its Save button, not as the select changes (a keyboard user reading the
    # options changes nothing), and making an owner asks first.
    teammate = f"{unique('member')}@example.com"

    def joined(role=None):
        from accounts.models import Membership
        from accounts.services import add_member, create_user

        membership = Membership.objects.filter(user__email=teammate).first()
        if membership is None:
            add_member(organization=Membership.objects.get(user__email=email).organization,
                       user=create_user(email=teammate, password=None), role="member")
        return Membership.objects.get(user__email=teammate).role

    db_call(joined)
    page.reload()
    role = page.locator(f"select[aria-label='Role of {teammate}']")
    role.focus()
    page.keyboard.press("ArrowUp")
    role.select_option("owner")
    # The page's dialogs are accepted (the fixture): this one is answered "Cancel".
    page.evaluate("window.confirm = (question) => { window.__asked = question; return false; }")
    page.click(f"button[aria-label='Save the role of {teammate}']")
    assert "an owner of Platform Ops" in page.evaluate("window.__asked")
    assert db_call(joined) == "member"  # neither the arrow nor the refused owner saved
    assert not page.locator(f".messages >> text={teammate} is now").count()
    role.select_option("admin")
    page.click(f"button[aria-label='Save the role of {teammate}']")
    page.wait_for_selector(f".messages >> text={teammate} is now admin")
    assert db_call(joined) == "admin"
    assert _fits_a_laptop(page, "#members-table") and _fits_a_laptop(page, "#invitations-table")
    # The switcher: a second organization, then back.
    page.click(".org-switcher summary")
    page.click(".org-menu >> text=New organization")
    page.fill("#id_name", "Research Lab")
    page.click("main button[type=submit]")
    page.wait_for_url(HOME)
    assert "Research Lab" in page.inner_text(".org-switcher summary")
    page.click(".org-switcher summary")
    shot(page, "21-org-switcher")
    page.click(".org-menu button:has-text('Platform Ops')")
    page.wait_for_url(HOME)
    assert "Platform Ops" in page.inner_text(".org-switcher summary")


def test_the_playground_bills_the_organization_on_screen_after_a_switch_in_another_tab(new_page, stack, db_call):
    """The playground's socket names the page's organization: reconnecting after the user switched
    organization in another tab still bills the one on screen; once the user left it, the
    playground shows why it is refused instead of billing another."""
    page = new_page()
    account = sign_up(page, name="Lin Playground", organization=unique("Shown"))
    other_name = unique("Elsewhere")

    def second_organization():
        from accounts.models import User
        from accounts.services import create_organization

        user = User.objects.get(email=account.email)
        shown = user.memberships.get().organization
        return user.pk, shown.pk, create_organization(name=other_name, owner=user).pk

    user_id, shown_id, other_id = db_call(second_organization)
    sockets = []  # every socket the playground opens, passed through to the server

    def through(ws):
        ws.connect_to_server()
        sockets.append(ws)

    page.route_web_socket(re.compile(r"/v1/ws(\?|$)"), through)
    page.goto("/playground/")
    page.wait_for_selector("#conn-state[data-state=open]")
    assert sockets[0].url.endswith(f"/v1/ws?organization={shown_id}")

    # Another tab switches the session to the other organization; then the playground reconnects.
    tab = page.context.new_page()
    tab.goto("/")
    tab.click(".org-switcher summary")
    tab.click(f".org-menu button:has-text('{other_name}')")
    tab.wait_for_url(HOME)
    assert other_name in tab.inner_text(".org-switcher summary")
    sockets[0].close()
    page.wait_for_selector("#conn-state[data-state=closed]")
    page.fill("#p-max-tokens", "4")
    page.fill("#chat-input", "Say hi.")
    page.keyboard.press("Enter")
    reply = page.locator(".msg.assistant").nth(0)
    page.wait_for_selector(".msg.assistant[data-state=done], .msg.assistant[data-state=error]", timeout=120_000)
    # (The other organization has no credit: billed there, the reply would be refused for its quota.)
    assert reply.get_attribute("data-state") == "done", reply.inner_text()
    assert len(sockets) == 2
    request_id = reply.get_attribute("data-api-request-id")

    def billed_to():
        from billing.models import UsageRecord

        return UsageRecord.objects.filter(request_id=request_id).values_list("organization_id", flat=True).first()

    assert wait_until(lambda: db_call(billed_to), timeout=30, message="the reply's usage record") == shown_id

    # The user leaves the organization on screen: the next connection is refused, saying why.
    def leave():
        from accounts.models import Organization, User
        from accounts.services import add_member, create_user, remove_member

        shown = Organization.objects.get(pk=shown_id)
        add_member(organization=shown, user=create_user(email=f"{unique('heir')}@example.com", password=None),
                   role="owner")
        remove_member(organization=shown, user=User.objects.get(pk=user_id))

    db_call(leave)
    sockets[1].close()
    page.wait_for_selector("#conn-state[data-state=closed]")
    page.fill("#chat-input", "Say hi again.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant[data-state=error]")
    refused = page.locator(".msg.assistant[data-state=error] .text").inner_text()
    assert "not a member of the organization this page was opened for" in refused, refused
    assert "Reload the page" in page.inner_text("#conn-state")
    shot(page, "22-playground-refused")
    assert not page.js_errors, page.js_errors


def test_the_playground_caps_max_tokens_at_the_selected_models_context(new_page, stack, db_call):
    """Max tokens goes up to the selected model's context, which the API refuses to exceed, and
    follows the selection; a model whose context the catalog does not know keeps the field's cap.
    A reply Max tokens cut short says so."""
    page = new_page()
    account = sign_up(page, name="Max Tokens", organization=unique("Context"))
    tag = unique("ctx").lower()

    def deployments():
        from accounts.models import Organization
        from models_catalog.models import CatalogModel
        from models_catalog.services import create_deployment

        organization = Organization.objects.get(name=account.organization)
        for suffix, context in (("short", 2048), ("unknown", 0)):
            model = CatalogModel.objects.create(slug=f"{tag}-{suffix}", display_name=f"Context {suffix}",
                                                architecture="llama", context_length=context,
                                                weights_path=f"{tag}-{suffix}.gguf")
            create_deployment(organization=organization, model=model, name=f"{tag}-{suffix}")

    db_call(deployments)
    page.goto(f"/playground/?deployment={DEPLOYMENT}")  # the bundled model: 8,192 tokens
    page.wait_for_selector("#conn-state[data-state=open]")
    assert page.get_attribute("#p-max-tokens", "max") == "8192"
    assert "8,192" in page.inner_text("#p-max-tokens-help")
    page.fill("#p-max-tokens", "20000")
    page.fill("#chat-input", "Say hi.")
    page.keyboard.press("Enter")
    assert "from 1 to 8,192" in page.inner_text("#p-max-tokens-error")
    assert page.locator(".msg").count() == 0  # refused before sending, not by an error reply

    page.fill("#p-max-tokens", "4000")
    page.select_option("#deployment-select", f"{tag}-short")
    assert page.get_attribute("#p-max-tokens", "max") == "2048"
    assert "from 1 to 2,048" in page.inner_text("#p-max-tokens-error")  # at once, not on the next send
    page.select_option("#deployment-select", DEPLOYMENT)
    assert page.get_attribute("#p-max-tokens", "max") == "8192" and not page.is_visible("#p-max-tokens-error")
    page.select_option("#deployment-select", f"{tag}-unknown")
    assert page.get_attribute("#p-max-tokens", "max") == "32768" and not page.is_visible("#p-max-tokens-help")

    page.select_option("#deployment-select", DEPLOYMENT)
    page.fill("#p-max-tokens", "3")  # far too few for the answer: the engine ends it with finish_reason "length"
    page.fill("#chat-input", "Count from one to twenty in words.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant[data-state=done] [data-cost]", timeout=120_000)
    reply = page.locator(".msg.assistant").nth(0)
    assert reply.locator("[data-cut]").inner_text() == "Cut at max tokens"
    assert reply.locator("[data-stopped]").count() == 0
    shot(page, "23-playground-cut")
    assert not page.js_errors, page.js_errors
