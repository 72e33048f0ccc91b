"""API keys in a real browser (KEY-1, KEY-3): headless Chromium against a real daphne, at a laptop's
1280x900 and a phone's 390x844.

Create a key: its secret is shown once, and the copy buttons put it (and a snippet) on the
clipboard. Revoke it from the list: a success message, a "revoked" badge. The key list's columns
are all visible at 1280 px, and no page scrolls sideways at 390 px. Screenshots land in
.cache/artifacts/ (git-ignored).
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from tests.e2e.test_browser import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    STAFF,
    WAIT_MS,
    _console_error,
    _require_browser,
    sign_in,
    staff_user,  # noqa: F401  (a fixture)
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

VIEWPORTS = {"laptop": (1280, 900), "phone": (390, 844)}
RAW_KEY = re.compile(r"mlxh_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}")
# The page's width beyond the window, and any list column whose right edge is past the window.
OVERFLOW = "document.documentElement.scrollWidth - window.innerWidth"
HIDDEN_COLUMNS = """() => Array.from(document.querySelectorAll('#result_list thead th'))
  .filter(th => th.getBoundingClientRect().right > window.innerWidth + 0.5)
  .map(th => th.textContent.trim())"""
RESULTS_SCROLL = """() => { const box = document.querySelector('#changelist .results');
  return box ? box.scrollWidth - box.clientWidth : 0; }"""


@pytest.fixture
def usage_history(staff_user):  # noqa: F811
    """A week of usage on an older key of the staff member, so the charts have something to draw."""
    from django.utils import timezone

    from models_app.catalogue import services
    from models_app.models import UsageDay

    key, _ = services.apikey_create(
        owner=staff_user, name="older", requests_per_minute=600, tokens_per_day=2_000_000
    )
    today = timezone.now().date()
    for days_ago in range(7):
        UsageDay.objects.create(
            day=today - timedelta(days=days_ago),
            owner=staff_user,
            key=key,
            requests=10 + days_ago,
            prompt_tokens=1000 * (days_ago + 1),
            cached_tokens=400 * days_ago,
            output_tokens=150 * (days_ago + 2),
        )
    return key


def assert_fits(page, width: int, where: str) -> None:
    overflow = page.evaluate(OVERFLOW)
    assert overflow <= 0, f"{where} at {width}px scrolls sideways by {overflow}px"


def create_key(page, name: str, width: int) -> str:
    page.goto("/admin/models_app/apikey/add/")
    assert_fits(page, width, "the add form")
    # The owner starts on the signed-in staff member.
    assert page.locator("#id_owner option:checked").inner_text() == STAFF
    page.fill("#id_name", name)
    page.fill("#id_requests_per_minute", "60")
    page.click("input[name=_save]")
    page.wait_for_url(re.compile(r"/admin/models_app/apikey/\d+/created/$"))
    return page.url


def copy_and_read(page, target: str) -> str:
    button = page.locator(f'button[data-copy="{target}"]')
    assert button.is_visible()
    button.click()
    page.wait_for_function("document.getElementById('mlxhost-copy-status').textContent.startsWith('Copied')")
    return page.evaluate("navigator.clipboard.readText()")


def revoke_from_the_list(page, name: str) -> None:
    page.goto("/admin/models_app/apikey/")
    row = page.locator("#result_list tbody tr", has_text=name)
    row.locator("input.action-select").check()
    page.select_option("select[name=action]", "revoke")
    page.click("#changelist-form button[name=index]")
    page.locator("h1", has_text="Revoke this key?").wait_for()  # it asks first
    page.screenshot(path=str(ARTIFACTS / f"keys-revoke-confirm-{page.viewport_size['width']}.png"))
    page.click("#confirm-revoke")
    page.locator(".messagelist .success", has_text=f"Revoked {name} (").wait_for()
    row.locator(".mlxhost-badge-revoked", has_text="revoked").wait_for()


# One test for both sizes: the server process caches content type ids, which a second
# transactional test's fresh database would no longer have.
def test_keys_are_easy_to_create_copy_and_revoke(
    daphne_server,
    staff_user,  # noqa: F811
    usage_history,
    tiny_alias,
    minilm_alias,
):
    """KEY-1, KEY-3: the secret is shown once with working copy buttons; revoking says so and
    badges the key; every column fits at 1280 px and nothing scrolls sideways at 390 px."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []  # uncaught exceptions and console errors, CSP violations included
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for device, (width, height) in VIEWPORTS.items():
                context = browser.new_context(
                    base_url=daphne_server.url, viewport={"width": width, "height": height}
                )
                context.grant_permissions(["clipboard-read", "clipboard-write"], origin=daphne_server.url)
                context.set_default_timeout(WAIT_MS)
                context.on("weberror", lambda error: errors.append(str(error.error)))
                context.on("console", lambda message: _console_error(message, errors))
                walk_through(context.new_page(), device, width, usage_history.pk)
                context.close()
        finally:
            browser.close()
    assert not errors, f"errors in the pages: {errors}"


def walk_through(page, device: str, width: int, older_key_id: int) -> None:
    name = f"laptop-{device}"
    sign_in(page)
    created = create_key(page, name, width)
    secret = page.inner_text("#mlxhost-secret").strip()
    assert RAW_KEY.fullmatch(secret), secret
    assert copy_and_read(page, "mlxhost-secret") == secret
    # The examples name the chat alias first, and the picker switches them to the embedding one.
    assert page.locator("#mlxhost-snippet-alias").is_visible()
    chat = copy_and_read(page, "snippet-tiny-curl")
    assert '"model": "tiny"' in chat and "/v1/chat/completions" in chat and secret in chat
    assert not page.locator("#snippet-minilm-curl").is_visible()
    page.select_option("#mlxhost-snippet-alias", "minilm")
    assert not page.locator("#snippet-tiny-curl").is_visible()
    embed = copy_and_read(page, "snippet-minilm-curl")
    assert '"model": "minilm"' in embed and "/v1/embeddings" in embed
    page.screenshot(path=str(ARTIFACTS / f"keys-created-embedding-{device}.png"), full_page=True)
    env = copy_and_read(page, "snippet-env")
    assert f"export OPENAI_API_KEY={secret}" in env and f"export ANTHROPIC_API_KEY={secret}" in env
    assert_fits(page, width, "the new key's page")
    page.screenshot(path=str(ARTIFACTS / f"keys-created-{device}.png"), full_page=True)
    page.goto(created)  # once: the secret is gone on the next visit
    assert secret not in page.content() and page.locator("#mlxhost-secret").count() == 0

    page.goto("/admin/models_app/apikey/")
    page.screenshot(path=str(ARTIFACTS / f"keys-list-{device}.png"), full_page=True)
    assert secret not in page.content()
    assert_fits(page, width, "the key list")
    if device == "laptop":
        assert page.evaluate(HIDDEN_COLUMNS) == []
        assert page.evaluate(RESULTS_SCROLL) <= 0, "the key list scrolls inside its box at 1280px"
    revoke_from_the_list(page, name)
    assert_fits(page, width, "the key list after a revoke")
    page.screenshot(path=str(ARTIFACTS / f"keys-revoked-{device}.png"), full_page=True)

    page.goto(f"/admin/models_app/apikey/{older_key_id}/change/")
    page.locator("#mlxhost-key-usage-section .uplot").wait_for()
    assert_fits(page, width, "a key's page")
    page.screenshot(path=str(ARTIFACTS / f"key-page-{device}.png"), full_page=True)
    page.goto("/admin/models_app/usageday/")
    page.locator("#mlxhost-usage .uplot").wait_for()
    page.screenshot(path=str(ARTIFACTS / f"usage-{device}.png"), full_page=True)
    assert_fits(page, width, "the usage page")
    if device == "laptop":
        assert page.evaluate(HIDDEN_COLUMNS) == []
        assert page.evaluate(RESULTS_SCROLL) <= 0, "the usage rows scroll inside their box at 1280px"
    page.screenshot(path=str(ARTIFACTS / f"usage-{device}.png"), full_page=True)
