"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against the real stack —
uvicorn serving the ASGI app, a Celery worker hosting the bundled model (the e2e fixtures), and
localstripe standing in for Stripe (its API, its signed webhooks and its Stripe.js).

Playwright's synchronous API keeps an event loop running in the test's thread, where Django's ORM
refuses to run; the tests read and write the database through ``db_call``, in a worker thread.
Screenshots of every page go to ``test-artifacts/browser/``.
"""

from __future__ import annotations

import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.billing.conftest import STRIPE_PUBLISHABLE_KEY, STRIPE_SECRET_KEY, WEBHOOK_SECRET, localstripe  # noqa: F401
from tests.conftest import child_env
from tests.e2e.conftest import DEPLOYMENT, asgi_server, inference_worker  # noqa: F401
from tests.support import REPO_ROOT

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = REPO_ROOT / "test-artifacts" / "browser"
PASSWORD = "browser-tests-password-7"


@pytest.fixture(scope="session")
def server_env(django_db_setup, django_db_blocker, tmp_path_factory, localstripe):  # noqa: F811
    """The e2e servers' settings plus Stripe pointed at localstripe (its API and its Stripe.js)."""
    with django_db_blocker.unblock():
        from django.core.management import call_command

        call_command("seed_catalog", verbosity=0)
    return child_env(
        GATEWAY_QUEUE_TIMEOUT="20", DATA_DIR=str(tmp_path_factory.mktemp("data")),
        RATE_LIMIT_KEY_RPM="100000", RATE_LIMIT_ORG_RPM="100000", LOG_LEVEL="WARNING",
        STRIPE_SECRET_KEY=STRIPE_SECRET_KEY, STRIPE_PUBLISHABLE_KEY=STRIPE_PUBLISHABLE_KEY,
        STRIPE_WEBHOOK_SECRET=WEBHOOK_SECRET, STRIPE_API_BASE=localstripe,
        STRIPE_JS_URL=f"{localstripe}/js.stripe.com/v3/",
    )


@pytest.fixture(scope="session")
def stack(asgi_server, inference_worker, localstripe):  # noqa: F811
    """Everything up, and localstripe's webhooks delivered to the platform. Yields the base URL."""
    response = httpx.post(f"{localstripe}/_config/webhooks/dashboard-browser-tests",
                          data={"url": f"{asgi_server}/billing/stripe/webhook", "secret": WEBHOOK_SECRET})
    assert response.status_code == 200, response.text
    return asgi_server


@pytest.fixture(scope="module")
def browser(stack):
    """Headless Chromium (started after the servers: see the module's note on the ORM). Module
    scope: Playwright's sync API keeps an event loop in this thread while it runs, which would make
    every later test's ORM call fail as "async context"."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM} (`apt-get install chromium`, as .ci/run does)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def new_page(browser, stack, localstripe):  # noqa: F811
    """A fresh browser context (its own cookies) at 1440×900; ``new_page(width=390)`` for a phone.

    Every page must work offline: at the end, no request may have left for another host (a CDN,
    web fonts), and every static asset must have loaded."""
    contexts, stray, broken = [], [], []
    allowed = (stack + "/", localstripe + "/", "data:", "blob:", "about:")

    def watch(request):
        if not request.url.startswith(allowed):
            stray.append(request.url)

    def check(response):
        if "/static/" in response.url and response.status >= 400:
            broken.append(f"{response.status} {response.url}")

    def make(width: int = 1440, height: int = 900):
        context = browser.new_context(base_url=stack, viewport={"width": width, "height": height},
                                      device_scale_factor=1)
        context.set_default_timeout(20_000)
        contexts.append(context)
        page = context.new_page()
        page.on("dialog", lambda dialog: dialog.accept())  # "Revoke this key?" and the like
        page.on("request", watch)
        page.on("response", check)
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.js_errors = errors
        return page

    yield make
    for context in contexts:
        context.close()
    assert not stray, f"requests left the platform: {stray}"
    assert not broken, f"static assets failed: {broken}"


def shot(page, name: str) -> Path:
    """A full-page screenshot under test-artifacts/browser/."""
    path = ARTIFACTS / f"{name}.png"
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(path), full_page=True)
    return path


def _in_thread(fn):
    from django.db import connections

    try:
        return fn()
    finally:
        connections.close_all()


@pytest.fixture
def db_call(django_db_blocker):
    """Run ``fn`` against the committed test database in a worker thread (see the module's note)."""

    def call(fn):
        with django_db_blocker.unblock(), ThreadPoolExecutor(1) as pool:
            return pool.submit(_in_thread, fn).result()

    return call


@dataclass
class Account:
    email: str
    password: str
    organization: str


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def sign_up(page, *, name: str, organization: str, confirm: bool = True) -> Account:
    """Sign up through the form; the browser ends logged in on the overview, the address confirmed
    (the link mailed to it opened: the sign-up credit is there) unless ``confirm`` is False."""
    email = f"{unique(name.lower().split()[0])}@example.com"
    page.goto("/signup/")
    page.fill("#id_name", name)
    page.fill("#id_email", email)
    page.fill("#id_password", PASSWORD)
    page.fill("#id_organization_name", organization)
    page.click("button[type=submit]")
    page.wait_for_url("**/")
    if confirm:
        confirm_email(page, email)
    return Account(email=email, password=PASSWORD, organization=organization)


def confirm_email(page, email: str) -> None:
    """Open the confirmation link the web server mailed to ``email`` (its mail goes to files)."""
    from tests.conftest import WORKER_MAIL
    from tests.support import wait_until

    def link():
        for path in WORKER_MAIL.glob("*") if WORKER_MAIL.exists() else ():
            text = path.read_text(errors="replace")
            if f"To: {email}" in text and (found := re.search(r"https?://[^/\s]+(/confirm-email/\S+/)", text)):
                return found.group(1)
        return None

    page.goto(wait_until(link, timeout=20, message=f"the confirmation email to {email}"))
    page.wait_for_url("**/")
