"""The live Models page and the dashboard's charts in headless Chromium against a real daphne, at
1280x900 and on a 390x844 phone (ADM-2, ADM-7, ADM-9, OPS-4).

Screenshots land in .cache/artifacts/; with MLXHOST_UPDATE_SCREENSHOTS=1 docs/console.md's copies in
docs/screenshots/ are rewritten too.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e import test_browser
from tests.e2e.test_browser import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    _console_error,
    _require_browser,
    artifacts_on_failure,
    sign_in,
)
from tests.support import register_alias, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("staff_user"),  # sign_in's user
]
staff_user = test_browser.staff_user  # the same fixture

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "docs" / "screenshots"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
MODEL, CHAT_ALIAS = "tiny-models", "tiny-models-chat"
LIVE_WITHIN_MS = 2000  # an unload shows on the open page within this, without a reload
WAIT_MS = 60_000
CHART_POINTS = 20  # reports the dashboard's charts hold before the screenshot (about 20 s)


@pytest.fixture
def two_aliases(tiny_model_dir, tiny_model_b_dir):
    """One model served by two aliases (REG-2): an unload takes both down. A second model beside
    it stays unloaded: its row and buttons keep to their own state."""
    alias = register_alias(name=MODEL, folder="tiny-llama", temperature=0.7)
    register_alias(name=CHAT_ALIAS, folder="tiny-llama", temperature=0.7)
    register_alias(name="tiny-models-b", folder="tiny-llama-b")
    return alias.model


@pytest.fixture
def browser(daphne_server) -> Iterator:
    _require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def open_context(browser, daphne_server) -> Iterator:
    """`open_context(viewport)`: a signed-in browser context; page errors (CSP included) fail the test."""
    contexts, errors = [], []

    def make(viewport: dict):
        context = browser.new_context(base_url=daphne_server.url, viewport=viewport)
        context.set_default_timeout(WAIT_MS)
        context.on("weberror", lambda error: errors.append(str(error.error)))
        context.on("console", lambda message: _console_error(message, errors))
        contexts.append(context)
        sign_in(context.new_page())
        return context

    yield make
    for context in contexts:
        context.close()
    assert not errors, f"errors in the pages: {errors}"


def save(page, name: str, *, full_page: bool = True) -> None:
    """A screenshot in .cache/artifacts/, and in docs/screenshots/ when asked to update them."""
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=full_page)
    if os.environ.get("MLXHOST_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SCREENSHOTS / name)


def page_width(page) -> int:
    return page.evaluate("document.documentElement.scrollWidth")


def model_row(page):
    return page.locator(f'#models-body tr[data-model="{MODEL}"]')


# Each phase as a load reports it (status frames come once a second, so the tiny model's load
# is too quick to catch them all live): the script's words for each, drawn in the page itself.
PHASES = """() => [
  {phase: "verify", done: 0, total: 0, unit: "bytes"},
  {phase: "download", done: 3, total: 7, unit: "files"},
  {phase: "download", done: 268435456, total: 539700000, unit: "bytes",
   file: "model-00002.safetensors", file_done: 104857600, file_total: 209715200},
  {phase: "read", done: 268435456, total: 539700000, unit: "bytes"},
  {phase: "build", done: 0, total: 0, unit: ""},
].map(p => { const node = window.mlxhost.loadProgress(p);
  return [node.textContent, node.querySelector("progress").hasAttribute("value")]; })"""


def test_a_load_shows_its_phases_as_they_are(daphne_server, two_aliases, open_context):
    """OPS-4: checking, downloading (files, or bytes and the file in flight), reading (bytes) and building each say so; only the
    phases that count show a percentage, so a build never shows "100 %" beside memory 0 B."""
    page = open_context(PHONE).new_page()
    page.goto("/dashboard/models/")
    page.wait_for_selector('#ws-state[data-state="open"]')
    assert page.evaluate(PHASES) == [
        ["checking the weights\u2026", False],
        ["downloading: 43% (3 of 7 files)", True],
        # A hub download (issue 28): the whole in bytes, and the file in flight with its own.
        ["downloading: 50% (256.0 MB of 514.7 MB), model-00002.safetensors: 100.0 MB of 200.0 MB", True],
        ["reading the weights: 50% (256.0 MB of 514.7 MB)", True],
        ["building the model in memory\u2026", False],
    ]


def new_api_key() -> str:
    """A key of the staff user's, minted on a thread of its own: the ORM cannot run on the test's
    thread once Playwright's loop does."""
    from concurrent.futures import ThreadPoolExecutor

    from django.contrib.auth import get_user_model
    from django.db import connection

    from models_app.catalogue import services

    def mint() -> str:
        try:
            owner = get_user_model().objects.get(username=test_browser.STAFF)
            return services.apikey_create(owner=owner, name="on-demand")[1]
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(mint).result()


def test_the_models_page_follows_an_unload_live_and_asks_first(daphne_server, two_aliases, open_context):
    """ADM-7, OPS-4: load from the Models page; an unload asks first, naming both aliases of the
    model, and the open pages (a desktop's and a phone's) show it unloaded within 2 s, without a
    reload; the buttons follow. A request then loads it on demand: the status line says that, the
    latest event, not "unload done" (issue 25 §7)."""
    context = open_context(DESKTOP)
    page = context.new_page()
    phone = open_context(PHONE).new_page()
    with artifacts_on_failure(context, daphne_server):
        for each in (page, phone):
            each.goto("/dashboard/models/")
            each.wait_for_selector('#ws-state[data-state="open"]')
            each.evaluate("window.mlxhostNotReloaded = true")  # gone if the page reloads
        row = model_row(page)
        assert row.locator("button[value=unload]").is_disabled()  # nothing to unload yet
        row.locator("button[value=load]").click()
        row.locator(".badge-resident").wait_for()
        row.locator("button[value=unload]:enabled").wait_for()
        assert row.locator("button[value=load]").is_disabled()
        assert row.locator(".unload").inner_text().startswith("in ")  # the keep-alive counts down
        for button in ("load", "unload", "reload"):
            assert row.locator(f"button[value={button}]").bounding_box()["height"] >= 32
        model_row(phone).locator(".badge-resident").wait_for()  # pushed to every open page
        save(page, "models-1280.png")
        save(phone, "models-390.png")

        # The "requested" line ends with the action: it says how it went (OPS-4).
        page.locator("#action-feedback", has_text=f"Load of {MODEL} done.").wait_for()
        assert "requested" not in page.inner_text("#action-feedback")
        said = page.inner_text("#action-feedback")
        row.locator("button[value=unload]").click()
        dialog = page.locator("#unload-dialog")
        dialog.wait_for()
        assert {MODEL, CHAT_ALIAS} <= set(dialog.locator("[data-fill=aliases] li").all_inner_texts())
        page.screenshot(path=str(ARTIFACTS / "models-unload-dialog.png"))
        dialog.locator("button[value=cancel]").click()  # asking is not doing
        assert dialog.is_hidden() and page.inner_text("#action-feedback") == said
        assert row.locator(".badge-resident").count() == 1

        row.locator("button[value=unload]").click()
        page.click("#unload-confirm")
        confirmed_at = time.monotonic()
        row.locator(".badge-not-loaded").wait_for(timeout=LIVE_WITHIN_MS)
        model_row(phone).locator(".badge-not-loaded").wait_for(timeout=LIVE_WITHIN_MS)
        assert time.monotonic() - confirmed_at <= LIVE_WITHIN_MS / 1000
        assert page.evaluate("window.mlxhostNotReloaded") is True
        assert phone.evaluate("window.mlxhostNotReloaded") is True
        assert row.locator(".memory").inner_text() == "\u2014"
        row.locator("button[value=load]:enabled").wait_for()
        assert row.locator("button[value=unload]").is_disabled()
        other = page.locator('#models-body tr[data-model="tiny-models-b"]')
        assert (
            other.locator(".badge-not-loaded").count() == 1
            and other.locator("button[value=load]").is_enabled()
        )
        assert page_width(page) <= DESKTOP["width"] and page_width(phone) <= PHONE["width"]
        assert row.locator(".last-action").inner_text() == "last: unload done"

        answer = httpx.post(
            f"{daphne_server.url}/v1/chat/completions",
            json={"model": CHAT_ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            headers={"Authorization": f"Bearer {new_api_key()}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        row.locator(".badge-resident").wait_for()
        row.locator(".last-action", has_text="last: loaded on demand since the unload").wait_for()


@pytest.fixture
def changelist_rows(staff_user) -> None:
    """A row in each changelist whose columns must all show: a stored response, a revoked key.
    (A fixture: the ORM cannot run once Playwright's loop does.)"""
    owner = staff_user
    from django.utils import timezone

    from models_app.catalogue import services
    from models_app.models import StoredResponse

    key, _ = services.apikey_create(owner=owner, name="ci runner with a long name")
    services.apikey_revoke(key=key)
    StoredResponse.objects.create(
        public_id="resp_" + "a" * 32,
        owner=owner,
        alias_name=CHAT_ALIAS,
        instance_id=1,
        weights_fingerprint="f" * 64,
        boot_id="b" * 32,
        previous_response_id="resp_" + "b" * 32,
        status="completed",
        expires_at=timezone.now() + timedelta(days=7),
    )


CHANGELISTS = (
    "/admin/models_app/modelalias/",
    "/admin/models_app/storedresponse/",
    "/admin/models_app/apikey/",
    "/admin/models_app/model/",
)


def test_no_page_overflows_and_no_column_is_cut(daphne_server, two_aliases, changelist_rows, open_context):
    """ADM-9: at 1280 px every changelist column shows (the table needs no sideways scroll); at
    390 px no staff page this issue touched scrolls sideways."""
    pk = two_aliases.pk
    pages = [
        "/admin/",
        "/dashboard/",
        "/dashboard/models/",
        f"/dashboard/models/{pk}/unload/",
        f"/admin/models_app/model/{pk}/change/",
        "/admin/models_app/model/add/",
        "/admin/models_app/modelalias/add/",
        *CHANGELISTS,
    ]
    desktop = open_context(DESKTOP).new_page()
    for url in CHANGELISTS:
        desktop.goto(url)
        results = desktop.locator("#changelist .results")
        scroll, client = results.evaluate("el => [el.scrollWidth, el.clientWidth]")
        assert scroll <= client, f"{url}: the table is {scroll} px wide in {client} px"
        assert page_width(desktop) <= DESKTOP["width"], url
    phone = open_context(PHONE).new_page()
    for url in pages:
        phone.goto(url)
        if url.startswith("/dashboard/") and url.count("/") <= 3:
            phone.wait_for_selector('#ws-state[data-state="open"]')
        width = page_width(phone)
        assert width <= PHONE["width"], f"{url} is {width} px wide on a {PHONE['width']} px screen"


def test_the_dashboard_charts_have_units_and_blank_first_token_times_when_unloaded(
    daphne_server, two_aliases, api_key, open_context
):
    """ADM-2: per instance, five charts with their units on the axes; the first-token time says it
    includes the queue wait, and is blank, not stale, once the model is unloaded."""
    context = open_context(DESKTOP)
    desktop = context.new_page()
    desktop.goto("/dashboard/")
    desktop.wait_for_selector('#ws-state[data-state="open"]')
    phone = open_context(PHONE).new_page()
    phone.goto("/dashboard/")
    phone.wait_for_selector('#ws-state[data-state="open"]')
    with artifacts_on_failure(context, daphne_server):
        card = desktop.locator(".chart-card").first
        chat_until(
            daphne_server.url, api_key, lambda: int(card.get_attribute("data-points") or 0) >= CHART_POINTS
        )
        row = desktop.locator("#instances-body tr", has_text=MODEL)
        row.locator(".ttft", has_text=re.compile(r"\d \(queue \d")).wait_for()
        card.locator(".uplot").nth(4).wait_for()
        captions = card.locator("figcaption").all_inner_texts()
        assert len(captions) == 5 and any("queue wait included" in text for text in captions)
        # uPlot draws the axes on canvas; each chart names its unit in its caption and its figure.
        units = [figure.get_attribute("data-unit") for figure in card.locator("figure.chart").all()]
        assert units == ["tokens/s", "requests", "ms", "bytes", "%"]
        assert all(f"({unit})" in caption for unit, caption in zip(units, captions, strict=True))
        assert "first token (incl. queue)" in card.inner_text() and "of which queue wait" in card.inner_text()
        assert page_width(phone) <= PHONE["width"]
        save(desktop, "dashboard-1280.png")
        phone.locator("#charts .uplot").first.scroll_into_view_if_needed()
        save(phone, "dashboard-390.png", full_page=False)

        models = context.new_page()  # unload it from the Models page, as staff do
        models.goto("/dashboard/models/")
        model_row(models).locator("button[value=unload]:enabled").click()
        models.click("#unload-confirm")
        row.locator(".badge-not-loaded").wait_for()
        wait_until(
            lambda: row.locator(".ttft").inner_text() == "\u2014", what="the first-token time to blank"
        )


def chat_until(url: str, api_key: str, done) -> None:
    """Short chats on both aliases, one after another, until `done()`: the charts have points to draw."""
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=60) as http:
        for turn in range(1000):
            if turn >= 2 and done():
                return
            body = {
                "model": (MODEL, CHAT_ALIAS)[turn % 2],
                "messages": [{"role": "user", "content": f"Tell me something, turn {turn}"}],
                "max_tokens": 48 + 32 * (turn % 4),
            }
            response = http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
    raise AssertionError("the charts never drew enough points")
