"""Staff run a model from a real browser: headless Chromium against a real daphne process.

Register the tiny model in the admin, load it, watch the dashboard, stream and cancel on the
chat page (/dashboard/chat/), unload it (ADM-1, ADM-2, API-3, API-5, OPS-4).
Screenshots land in .cache/artifacts/ (git-ignored).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ARTIFACTS = ROOT / ".cache" / "artifacts"
STAFF, PASSWORD = "staff-e2e", "pw-staff-e2e-123"
ALIAS = "tiny-browser"
WAIT_MS = 60_000
NO_BROWSER = f"headless Chromium is not installed at {CHROMIUM} (apt-get install chromium)"
CHAT = "/dashboard/chat/"  # the chat page; the dashboard links to it


def _require_browser() -> None:
    """In CI (MLXHOST_REQUIRE_SERVICES=1) a missing browser fails the test; elsewhere it skips."""
    required = os.environ.get("MLXHOST_REQUIRE_SERVICES") == "1"
    if shutil.which(CHROMIUM) is None:
        if required:
            pytest.fail(f"MLXHOST_REQUIRE_SERVICES=1 but {NO_BROWSER}")
        pytest.skip(NO_BROWSER)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if required:
            raise
        pytest.skip("the playwright package is not installed (pip install -r requirements-dev.txt)")


@pytest.fixture
def staff_user(django_user_model):
    from django.contrib.auth.hashers import PBKDF2PasswordHasher

    user = django_user_model.objects.create_user(username=STAFF, is_staff=True, is_superuser=True)
    # The test settings hash with MD5, which daphne's settings do not accept; few rounds keep it quick.
    hasher = PBKDF2PasswordHasher()
    user.password = hasher.encode(PASSWORD, hasher.salt(), iterations=1000)
    user.save(update_fields=["password"])
    return user


@pytest.fixture
def browser_context(daphne_server) -> Iterator:
    _require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(base_url=daphne_server.url, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(WAIT_MS)
        errors: list[str] = []  # uncaught exceptions, and console errors such as CSP violations
        context.on("weberror", lambda error: errors.append(str(error.error)))
        context.on("console", lambda message: _console_error(message, errors))
        expected: list[str] = []  # a test names the console errors it causes on purpose
        context.expect_console_error = expected.append
        try:
            yield context
        finally:
            browser.close()
        errors = [error for error in errors if not any(part in error for part in expected)]
        assert not errors, f"errors in the pages: {errors}"


def _console_error(message, errors: list[str]) -> None:
    url = message.location.get("url", "")
    if message.type == "error" and not url.endswith("/favicon.ico"):  # the site has no icon
        errors.append(f"{message.text} ({url})")


def sign_in(page) -> None:
    page.goto("/admin/login/?next=/admin/")
    page.fill("#id_username", STAFF)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")


def register_alias(page) -> None:
    """Register the weights as a model, then an alias of it from the model page's link; end on the
    model's change page, where the load and unload buttons are."""
    page.goto("/admin/models_app/model/add/")
    page.fill("#id_name", ALIAS)
    page.select_option("#id_source_kind", "local")
    page.fill("#id_local_path", "tiny-llama")
    page.click("input[name=_continue]")  # save, and stay on the change page with its action buttons
    page.wait_for_url(re.compile(r"/admin/models_app/model/\d+/change/"))
    model_page = page.url
    page.click("text=Add an alias of this model")
    page.fill("#id_name", ALIAS)
    page.fill("#id_temperature", "0")
    page.click("input[name=_save]")
    page.wait_for_url(re.compile(r"/admin/models_app/modelalias/$"))
    page.goto(model_page)


def alias_action(page, action: str, state: str) -> None:
    """Press the model page's load/unload button (an unload asks first: confirm it), then reload
    until it is in `state`."""
    page.click(f"button[name=action][value={action}]")
    if action == "unload":
        page.click("#confirm-unload")
    page.wait_for_url(re.compile(r"/admin/models_app/model/\d+/change/"))
    for _ in range(120):
        if page.locator(f"#mlxhost-live .mlxhost-state-{state}").count():
            return
        page.wait_for_timeout(500)
        page.reload()
    raise AssertionError(f"{ALIAS} never became {state}: {page.inner_text('#mlxhost-live')}")


def watch_the_dashboard(dash):
    """Step 3: the row is pushed over /ws/dashboard (live state, then charts); returns the row."""
    dash.goto("/dashboard/")
    dash.wait_for_selector('#ws-state[data-state="open"]')
    row = dash.locator("#instances-body tr", has_text=ALIAS)
    row.locator(".badge-resident").wait_for()
    dash.locator(f'#aliases-table tr[data-alias="{ALIAS}"] .badge-resident').wait_for()
    dash.locator(".chart-card .uplot").first.wait_for()
    assert row.locator(".ttft").inner_text() == "\u2014"  # nothing generated yet
    return row


TURN = "#chat-transcript li.chat-turn"
FINISHED = f"{TURN}[data-status]:not([data-status=pending]):not([data-status=streaming])"


def open_chat(page) -> None:
    page.goto(CHAT)
    page.wait_for_selector('#chat-socket[data-state="open"]')
    page.select_option("#chat-model", ALIAS)


def chat_settings(page, *, temperature: str, max_output_tokens: str) -> None:
    """Fill the folded Settings (opened for it, folded again)."""
    if page.locator("#chat-settings").get_attribute("open") is None:
        page.click("#chat-settings summary")
    page.fill("#chat-temperature", temperature)
    page.fill("#chat-max-output-tokens", max_output_tokens)
    page.click("#chat-settings summary")


def chat_turn(page, text: str) -> None:
    page.fill("#chat-input", text)
    page.click("#chat-send")


def finished_turn(page, index: int):
    turn = page.locator(TURN).nth(index)
    turn.and_(page.locator(FINISHED)).wait_for()
    return turn


def figure(turn, name: str) -> str:
    return turn.locator(f'.chat-figures [data-figure="{name}"] dd').inner_text()


def converse(chat, row) -> None:
    """Step 4: a turn on the chat page reaches the dashboard's row (pushed, not reloaded), and the
    next turn continues it by previous_response_id. (The chat page's own figures and words are
    tests/e2e/test_chat_page.py's.)"""
    chat_settings(chat, temperature="0.7", max_output_tokens="24")  # greedy decoding only says "\n"
    chat_turn(chat, "Hello there")
    first = finished_turn(chat, 0)
    assert first.get_attribute("data-status") in ("completed", "incomplete")
    first_id = first.get_attribute("data-response-id")
    assert first_id and continues(chat) == first_id
    row.locator(".ttft", has_text=re.compile(r"\d")).wait_for()  # pushed, not reloaded

    # previous_response_id: a warm session after a clean finish, else a replay (SES-1 keeps
    # nothing of a truncated turn); "fresh" would mean the id was not sent.
    chat_settings(chat, temperature="0.7", max_output_tokens="8")
    chat_turn(chat, "And then?")
    second = finished_turn(chat, 1)
    cache = figure(second, "cache")
    assert cache.split(" ")[0] in ("hit", "cold_replay"), cache
    if cache.startswith("hit"):
        assert not cache.split(" \u00b7 ")[1].startswith("0 "), cache  # tokens came from the cache
    second_id = second.get_attribute("data-response-id")
    assert second_id not in (None, first_id)
    assert continues(chat) == second_id


def continues(chat) -> str | None:
    """The reply the chat page's next turn continues (its data-response). A chat begun on this
    page says "New conversation" in words: its own replies are not "a previous reply" (only a
    page opened on a stored reply names it; tests/models_app/test_chat.py)."""
    tip = chat.locator("#chat-conversation")
    assert tip.inner_text() == "New conversation", tip.inner_text()
    return tip.get_attribute("data-response")


def queue_then_cancel(chat, other, row) -> None:
    """Step 5: a long answer streams; a second tab waits in the lane and shows its position;
    Stop ends the first, and the second then runs."""
    chat.click("#chat-new")
    assert chat.locator("#chat-transcript li").count() == 0
    assert chat.inner_text("#chat-conversation") == "New conversation"
    open_chat(other)
    chat_settings(chat, temperature="0", max_output_tokens="4000")  # greedy: never EOS here
    chat_turn(chat, "Count to a thousand")
    chat.locator(f'{TURN}[data-status="streaming"]').wait_for()

    chat_settings(other, temperature="0", max_output_tokens="4")
    chat_turn(other, "Hi")
    waiting = other.locator(TURN).nth(0)
    waiting.locator(".chat-status", has_text="Queued: position 1").wait_for()
    assert waiting.get_attribute("data-status") == "pending"
    row.locator(".lane", has_text=re.compile(r"^1 / 1 / ")).wait_for()  # the dashboard sees the queue
    other.locator("#chat").screenshot(path=str(ARTIFACTS / "chat-queued.png"))

    chat.click("#chat-stop")
    stopped = finished_turn(chat, 0)
    assert stopped.get_attribute("data-status") == "cancelled"
    assert stopped.locator(".chat-md").text_content()  # it keeps what it wrote
    assert 0 < int(figure(stopped, "tokens").split(" / ")[1].split(" ")[0]) < 4000

    ran = finished_turn(other, 0)
    assert ran.get_attribute("data-status") in ("completed", "incomplete")
    assert "Queued" not in ran.locator(".chat-status").text_content()
    row.locator(".lane", has_text=re.compile(r"^0 / 0 / ")).wait_for()  # the slot is free again


@contextmanager
def artifacts_on_failure(context, server) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for number, page in enumerate(context.pages):
            page.screenshot(path=str(ARTIFACTS / f"failure-{number}.png"), full_page=True)
        sys.stderr.write(f"daphne log (tail):\n{server.output()[-6000:]}\n")
        raise


def test_staff_registers_loads_watches_tries_and_unloads_a_model(
    daphne_server, tiny_model_dir, staff_user, browser_context
):
    """ADM-1, ADM-2, API-3, OPS-4: the whole fleet workflow from the browser."""
    with artifacts_on_failure(browser_context, daphne_server):
        admin = browser_context.new_page()
        sign_in(admin)
        register_alias(admin)  # 1
        alias_action(admin, "load", "resident")  # 2

        dash = browser_context.new_page()
        row = watch_the_dashboard(dash)  # 3
        dash.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        chat = browser_context.new_page()
        open_chat(chat)
        converse(chat, row)  # 4
        queue_then_cancel(chat, browser_context.new_page(), row)  # 5
        chat.locator("#chat").screenshot(path=str(ARTIFACTS / "chat-cancelled.png"))

        alias_action(admin, "unload", "unloaded")  # 6, and the open dashboard hears it
        row.locator(".badge-not-loaded").wait_for()
        assert row.locator(".memory").inner_text() == "0 B"


def test_the_dashboard_reconnects_after_its_socket_drops(daphne_server, staff_user, browser_context):
    """ADM-2: a dropped /ws/dashboard shows as reconnecting, then comes back live with backoff."""
    attempts: list[str] = []

    def drop_the_first(ws) -> None:
        attempts.append(ws.url)
        if len(attempts) == 1:
            ws.close(code=1011, reason="test: dropped")
        else:
            ws.connect_to_server()  # from the second try on, the real server answers

    page = browser_context.new_page()
    sign_in(page)
    page.route_web_socket(re.compile(r"/ws/dashboard$"), drop_the_first)
    page.goto("/dashboard/")
    page.wait_for_selector('#ws-state[data-state="reconnecting"]')
    assert "retrying in" in page.inner_text("#ws-state")
    page.wait_for_selector('#ws-state[data-state="open"]')
    assert len(attempts) == 2


def test_the_chat_page_shows_error_frames(daphne_server, tiny_alias, staff_user, browser_context):
    """API-3: an error frame (here a mocked 429 with retry_after) is shown with its status, type,
    code, message and retry time; the turn ends failed and the input is given back to send again."""
    page = browser_context.new_page()
    sign_in(page)

    def refuse(ws) -> None:
        error = {
            "message": "The queue is full.",
            "type": "rate_limit_error",
            "code": "queue_full",
            "param": None,
        }
        ws.on_message(
            lambda _m: ws.send(json.dumps({"type": "error", "status": 429, "error": error, "retry_after": 3}))
        )

    page.route_web_socket(re.compile(r"/ws/v1/responses$"), refuse)
    page.goto(CHAT)
    page.wait_for_selector('#chat-socket[data-state="open"]')
    page.select_option("#chat-model", tiny_alias.name)
    chat_turn(page, "Hello")
    failed = page.locator(f'{TURN}[data-status="failed"]')
    failed.wait_for()
    error = failed.locator(".chat-status").inner_text()
    assert error == "The model is busy: its queue is full. Try again in 3 s."
    assert failed.locator(".chat-error-code").inner_text() == "429 \u00b7 queue_full"
    assert page.locator(TURN).count() == 1
    assert page.input_value("#chat-input") == "Hello"  # given back, to send again
    assert page.is_enabled("#chat-send") and page.is_disabled("#chat-stop")


# A socket of the page's own, beside the chat page's: it records every frame and its close code.
PROBE_JS = """(model) => new Promise((resolve, reject) => {
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const ws = new WebSocket(scheme + location.host + "/ws/v1/responses");
  const probe = (window.probe = { ws, frames: [], closed: null });
  probe.create = () => ws.send(JSON.stringify(
    { type: "response.create", model, input: "Hi", max_output_tokens: 2, store: false }));
  ws.onmessage = (m) => probe.frames.push(JSON.parse(m.data).type);
  ws.onclose = (e) => { probe.closed = e.code; };
  ws.onopen = () => resolve();
  ws.onerror = () => reject(new Error("the probe socket failed"));
})"""
PROBE_DONE = "() => window.probe.frames.some(t => t === 'response.completed' || t === 'response.incomplete')"


def test_a_logged_out_tab_is_closed_and_cannot_generate(
    daphne_server, tiny_alias, staff_user, browser_context
):
    """API-5: signing out in one tab closes the other tabs' sockets with 4401 within seconds (the
    dashboard's, the chat page's, the Models page's and any other). Each page says the session
    ended, with a link to log in again, and turns its controls off; none blames the engines. A
    Models page whose socket did not hear of it is told by its action's 401 (not "undefined")."""
    with artifacts_on_failure(browser_context, daphne_server):
        dash = browser_context.new_page()
        dash.set_viewport_size({"width": 1280, "height": 900})
        sign_in(dash)
        dash.goto("/dashboard/")
        dash.wait_for_selector('#ws-state[data-state="open"]')
        chat = browser_context.new_page()
        chat.set_viewport_size({"width": 390, "height": 844})
        chat.goto(CHAT)
        chat.wait_for_selector('#chat-socket[data-state="open"]')
        chat.select_option("#chat-model", tiny_alias.name)
        chat.evaluate(PROBE_JS, tiny_alias.name)
        chat.evaluate("() => window.probe.create()")
        chat.wait_for_function(PROBE_DONE)  # the session generates while it lasts
        assert chat.is_enabled("#chat-send")
        models = browser_context.new_page()
        models.set_viewport_size({"width": 1280, "height": 900})
        models.goto("/dashboard/models/")
        models.wait_for_selector('#ws-state[data-state="open"]')
        # The published status says the model is resident before a page renders from it (the
        # status that a page opened earlier saw may still say "loading").
        models.wait_for_selector(f'tr[data-model="{tiny_alias.model.name}"] button[value=reload]:enabled')
        deaf = browser_context.new_page()  # a Models page whose socket never hears the logout
        deaf.set_viewport_size({"width": 390, "height": 844})
        deaf.route_web_socket(re.compile(r"/ws/dashboard$"), lambda ws: None)
        deaf.goto("/dashboard/models/")
        reload_button = deaf.locator(f'tr[data-model="{tiny_alias.model.name}"] button[value=reload]')
        assert reload_button.is_enabled()  # the page's own status says the model is resident

        other = browser_context.new_page()
        other.goto("/admin/")
        other.click("#logout-form button[type=submit]")
        other.wait_for_url("**/admin/logout/")

        seconds = {"timeout": 5_000}
        chat.wait_for_function("() => window.probe.closed === 4401", **seconds)
        for page, state in ((dash, "#ws-state"), (chat, "#chat-socket"), (models, "#ws-state")):
            page.wait_for_selector(f'{state}[data-state="denied"]', **seconds)
            assert page.inner_text(state) == "not live: the session ended"
            assert_session_ended(page)
        models.wait_for_function(
            "() => document.getElementById('engines-summary').textContent.startsWith('Not live')"
        )
        assert "no engine" not in models.inner_text("#engines-summary")
        assert models.locator("button[name=action]:enabled").count() == 0
        dash.screenshot(path=str(ARTIFACTS / "session-ended-dashboard-1280.png"))
        chat.screenshot(path=str(ARTIFACTS / "session-ended-chat-390.png"))

        assert chat.evaluate("() => window.probe.ws.readyState") == 3  # CLOSED: nothing can be sent
        assert chat.is_disabled("#chat-send") and chat.is_disabled("#chat-input")
        chat.evaluate("() => { const i = document.getElementById('chat-input'); i.disabled = false; }")
        chat.fill("#chat-input", "Still there?")
        chat.press("#chat-input", "Enter")  # Enter sends, when it can: here it must not
        assert chat.locator(TURN).count() == 0 and chat.input_value("#chat-input") == "Still there?"

        browser_context.expect_console_error("status of 401 (Unauthorized)")  # Chromium logs the answer
        reload_button.click()  # the deaf page still thinks it may: the server's 401 tells it
        deaf.locator("#action-feedback", has_text="your session has ended").wait_for()
        assert "undefined" not in deaf.inner_text("#action-feedback")
        assert_session_ended(deaf)
        assert deaf.inner_text("#ws-state") == "not live: the session ended"  # its socket is closed
        assert reload_button.is_disabled()
        deaf.screenshot(path=str(ARTIFACTS / "session-ended-models-390.png"))
        for page, path in ((chat, CHAT), (dash, "/dashboard/")):
            page.reload()  # the page itself is gone with the login
            page.wait_for_url(re.compile(rf"/admin/login/\?next={re.escape(path)}"))


def assert_session_ended(page) -> None:
    """The banner says it, links to the login with the way back, and no control is left on."""
    banner = page.locator("#session-ended")
    banner.wait_for()
    assert "Your session has ended" in banner.inner_text()
    path = page.evaluate("location.pathname")
    assert page.get_attribute("#session-login", "href") == f"/admin/login/?next={quote(path, safe='')}"
    enabled = "#content :is(button, input, select, textarea):enabled"
    assert page.locator(enabled).count() == 0, page.locator(enabled).evaluate_all(
        "els => els.map(e => e.outerHTML)"
    )


@pytest.fixture
def an_api_key(staff_user):
    """A key, so the walk visits a key's pages too (made before the browser's loop starts)."""
    from models_app.catalogue import services

    return services.apikey_create(owner=staff_user, name="walked")[0]


def test_every_admin_page_keeps_its_policy_and_breaks_nothing_under_it(
    daphne_server, tiny_alias, an_api_key, staff_user, browser_context
):
    """OPS-7: walked in a real browser from the admin index (every page linked, the dashboard,
    Models and chat pages too), each page arrives with its Content-Security-Policy, and none logs a
    violation of it (the context fails the test on any console error). A download link (the usage
    CSV) is fetched with the session, not navigated to: it is a file, not a page."""
    page = browser_context.new_page()
    sign_in(page)
    seen: list[str] = []
    downloads: set[str] = set()
    queue = ["/admin/", "/dashboard/"]
    ours = "a[href^='/admin/'], a[href^='/dashboard/']"
    hrefs = "els => els.map(e => e.getAttribute('href'))"
    while queue and len(seen) < 200:
        path = queue.pop(0)
        if path in seen or path.endswith("/logout/"):
            continue
        seen.append(path)
        response = page.goto(path)
        assert response is not None and response.status < 400, path
        csp = response.header_value("content-security-policy") or ""
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
        links = page.eval_on_selector_all(f":is({ours}):not([download])", hrefs)
        queue += [link.split("?")[0].split("#")[0] for link in links]
        downloads.update(page.eval_on_selector_all(f":is({ours})[download]", hrefs))
    for link in sorted(downloads):
        response = page.request.get(link)
        disposition = response.headers.get("content-disposition") or ""
        assert response.status < 400 and disposition.startswith("attachment"), link
    assert "/admin/models_app/usageday/export.csv" in {link.split("?")[0] for link in downloads}
    for must in (
        f"/admin/models_app/model/{tiny_alias.model_id}/history/",
        f"/admin/models_app/modelalias/{tiny_alias.pk}/delete/",
        f"/admin/models_app/apikey/{an_api_key.pk}/change/",
        "/admin/auth/user/add/",
        "/dashboard/models/",
        "/dashboard/chat/",
        "/dashboard/",
    ):
        assert must in seen, must
