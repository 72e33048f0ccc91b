"""The chat page in headless Chromium against a real daphne with the tiny model (ADM-4, API-3).

At a desktop and a phone size: a reply streams with its figures, a reply is stopped ("Stopped"), a
cut-off one says so, the last reply is regenerated on the same parent, a reload reopens the
conversation from the server, and at 390 px nothing overflows sideways and Send stays in view.
Model output with markup is inert (a mocked socket feeds it). Screenshots go to .cache/artifacts/
(git-ignored), or to MLXHOST_SCREENSHOTS_DIR: `MLXHOST_SCREENSHOTS_DIR=docs/screenshots` refreshes
docs/console.md's.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.e2e import test_browser
from tests.e2e.test_browser import CHROMIUM, CHROMIUM_ARGS, PASSWORD, STAFF, _require_browser
from tests.support import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".cache" / "artifacts"
SCREENSHOTS = ROOT / os.environ.get(
    "MLXHOST_SCREENSHOTS_DIR", ".cache/artifacts"
)  # absolute, or under the repo
WAIT_MS = 60_000
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
TURN = "#chat-transcript li.chat-turn"
FINISHED = f"{TURN}[data-status]:not([data-status=pending]):not([data-status=streaming])"


staff_user = test_browser.staff_user  # the same fixture as the other browser tests


@pytest.fixture
def browser(daphne_server) -> Iterator:
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def open_context(browser, daphne_server) -> Iterator:
    """A factory of signed-out browser contexts at a viewport; page errors (CSP violations too) fail the test."""
    errors: list[str] = []
    contexts = []

    def make(viewport: dict[str, int]):
        context = browser.new_context(base_url=daphne_server.url, viewport=viewport, device_scale_factor=1)
        context.set_default_timeout(WAIT_MS)
        context.grant_permissions(["clipboard-read", "clipboard-write"])
        context.on("weberror", lambda error: errors.append(str(error.error)))
        context.on("console", lambda message: _console_error(message, errors))
        contexts.append(context)
        return context

    yield make
    for context in contexts:
        context.close()
    assert not errors, f"errors in the pages: {errors}"


def _console_error(message, errors: list[str]) -> None:
    url = message.location.get("url", "")
    if message.type == "error" and not url.endswith("/favicon.ico"):
        errors.append(f"{message.text} ({url})")


def signed_in_chat(context, query: str = ""):
    page = context.new_page()
    page.goto("/admin/login/?next=/admin/")
    page.fill("#id_username", STAFF)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")
    page.goto(f"/dashboard/chat/{query}")
    page.wait_for_selector('#chat-socket[data-state="open"]')
    return page


def settings(page, *, temperature: str, max_output_tokens: str) -> None:
    details = page.locator("#chat-settings")
    if details.get_attribute("open") is None:
        page.click("#chat-settings summary")
    page.fill("#chat-temperature", temperature)
    page.fill("#chat-max-output-tokens", max_output_tokens)
    page.click("#chat-settings summary")  # fold it again: the phone has little room


def say(page, text: str) -> None:
    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")


def finished_turn(page, index: int):
    turn = page.locator(TURN).nth(index)
    turn.and_(page.locator(FINISHED)).wait_for()
    return turn


def figure(turn, name: str) -> str:
    return turn.locator(f'.chat-figures [data-figure="{name}"] dd').inner_text()


def no_sideways_overflow(page, width: int) -> None:
    scroll_width = page.evaluate("document.documentElement.scrollWidth")
    assert scroll_width <= width, f"the page is {scroll_width} px wide at {width} px"


def send_in_view(page, height: int) -> None:
    top, bottom = page.locator("#chat-send").evaluate(
        "b => [b.getBoundingClientRect().top, b.getBoundingClientRect().bottom]"
    )
    assert top >= 0 and bottom <= height, f"Send spans {top}..{bottom}, outside the {height} px window"


def stored(public_id: str, server=None):
    """The stored row `public_id`, once the server wrote it. Read from a thread of its own: the
    ORM refuses the thread where Playwright's event loop runs. A row that never lands fails with
    the tails of the server's and its Celery worker's logs, which say why."""
    from models_app.models import StoredResponse

    def row():
        return wait_until(
            lambda: StoredResponse.objects.filter(public_id=public_id).first(),
            timeout=60,
            what=f"{public_id} to land",
        )

    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            return pool.submit(row).result()
        except AssertionError as missing:
            raise AssertionError(f"{missing}\n{server_logs(server)}") from None


def server_logs(server, lines: int = 40) -> str:
    if server is None:
        return ""
    tails = []
    for log in (server.log, server.log.with_name("celery.log")):
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name} ---\n" + "\n".join(tail))
    return "\n".join(tails)


@pytest.mark.parametrize(
    "viewport", [pytest.param(DESKTOP, id="1280x900"), pytest.param(PHONE, id="390x844")]
)
def test_a_reply_streams_is_cut_off_regenerated_and_stopped(
    daphne_server, tiny_alias, staff_user, open_context, viewport
):
    """ADM-4, API-3, LANE-6: the chat page's whole turn cycle, in words and figures."""
    width, height = viewport["width"], viewport["height"]
    page = signed_in_chat(open_context(viewport))
    page.select_option("#chat-model", tiny_alias.name)
    send_in_view(page, height)
    no_sideways_overflow(page, width)

    # 1. A reply streams, with the server's figures and their definitions.
    settings(page, temperature="0.7", max_output_tokens="24")  # greedy decoding says only "\n"
    say(page, "Hello there")
    first = finished_turn(page, 0)
    assert first.get_attribute("data-status") in ("completed", "incomplete")
    first_id = first.get_attribute("data-response-id")
    assert stored(first_id, daphne_server).output_text  # it said something (the tiny model's words are noise)
    assert re.fullmatch(r"\d+ ms", figure(first, "queue"))
    assert re.fullmatch(r"\d+ ms", figure(first, "ttft"))
    assert figure(first, "cache").startswith("fresh")
    assert re.fullmatch(r"\d+ in / [1-9]\d* out", figure(first, "tokens"))
    legend = page.locator('#chat-legend [data-figure="queue"] dd').text_content()
    assert first.locator('.chat-figures [data-figure="queue"]').get_attribute("title") == legend
    assert page.url.endswith(f"?response={first_id}")
    # A new chat's own reply is not "a previous reply" it continues.
    assert page.locator("#chat-conversation").inner_text() == "New conversation"
    sidebar = page.locator("#chat-recent li[data-root]")
    sidebar.first.wait_for()  # live: the conversation joins the sidebar as its first turn ends
    assert sidebar.count() == 1 and sidebar.first.locator("a").inner_text() == "Hello there"
    assert sidebar.first.locator("a").get_attribute("href") == f"?response={first_id}"

    # 2. A reply that reaches max_output_tokens says so in words; it continues the first.
    settings(page, temperature="0", max_output_tokens="3")
    say(page, "Go on")
    second = finished_turn(page, 1)
    assert second.get_attribute("data-status") == "incomplete"
    assert second.locator(".chat-status").inner_text() == "Cut off at the token limit"
    assert figure(second, "cache").split(" ")[0] in ("hit", "cold_replay")
    second_id = second.get_attribute("data-response-id")
    assert stored(second_id, daphne_server).previous_response_id == first_id

    # 3. Regenerate the last reply: a new response on the same parent, in its place.
    send_in_view(page, height)
    second.locator(".chat-regen").click()
    page.wait_for_function(
        "id => { const t = document.querySelectorAll('#chat-transcript li.chat-turn');"
        " const last = t[t.length - 1]; return t.length === 2 && last.dataset.responseId"
        " && last.dataset.responseId !== id && last.dataset.status === 'incomplete'; }",
        arg=second_id,
    )
    regenerated_id = page.locator(TURN).nth(1).get_attribute("data-response-id")
    assert stored(regenerated_id, daphne_server).previous_response_id == first_id
    assert page.locator(TURN).nth(0).locator(".chat-regen").is_hidden()  # only the last reply

    # 4. Stop a running reply: it keeps what it wrote and says "Stopped".
    settings(page, temperature="0", max_output_tokens="4000")
    say(page, "Count to a thousand")
    page.locator(f'{TURN}[data-status="streaming"]').wait_for()
    assert page.is_disabled("#chat-send")
    send_in_view(page, height)
    page.click("#chat-stop")
    stopped = finished_turn(page, 2)
    assert stopped.get_attribute("data-status") == "cancelled"
    assert stopped.locator(".chat-status").inner_text() == "Stopped"
    assert 0 < int(figure(stopped, "tokens").split(" / ")[1].split(" ")[0]) < 4000
    assert page.is_enabled("#chat-send") and page.is_disabled("#chat-stop")
    stopped_id = stopped.get_attribute("data-response-id")
    assert sidebar.count() == 1  # one conversation, however many branches
    assert sidebar.first.locator("a").get_attribute("href") == f"?response={stopped_id}"
    no_sideways_overflow(page, width)
    send_in_view(page, height)
    # 5. Copy puts the reply's text on the clipboard.
    first.locator(".chat-copy").click()
    first.locator(".chat-copy", has_text="Copied").wait_for()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert (
        copied and copied == stored(first_id, daphne_server).output_text
    )  # the reply as written, not as rendered

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    if width > 800:
        page.screenshot(path=str(SCREENSHOTS / "chat-desktop.png"), full_page=True)
    else:  # the window as a phone shows it: Send in view under the last reply
        page.screenshot(path=str(SCREENSHOTS / "chat-phone.png"))

    # 6. The server holds the conversation: a reload reopens it from the stored rows.
    stored(stopped_id, daphne_server)
    first_figures = [figure(first, name) for name in ("queue", "ttft", "cache")]
    page.reload()
    page.wait_for_selector('#chat-socket[data-state="open"]')
    turns = page.locator(TURN)
    assert turns.count() == 3
    assert [turns.nth(i).get_attribute("data-response-id") for i in range(3)] == [
        first_id,
        regenerated_id,
        stopped_id,
    ]
    assert turns.nth(2).locator(".chat-status").inner_text() == "Stopped"
    assert page.locator("#chat-recent .chat-current a").get_attribute("href") == f"?response={stopped_id}"
    # The sidebar: one conversation, by its opening words, with its branches (the cut-off reply
    # that was regenerated is one); the turn's figures came back with it.
    assert sidebar.count() == 1
    assert sidebar.first.locator("a").inner_text() == "Hello there"
    assert "3 turns · 2 branches" in sidebar.first.inner_text()
    # One rendering live and after a reload: the cache figure keeps its word ("fresh · N of M").
    assert [figure(turns.nth(0), name) for name in ("queue", "ttft", "cache")] == first_figures
    no_sideways_overflow(page, width)
    send_in_view(page, height)
    if width > 800:
        stored_response_page(
            page, stored(stopped_id, daphne_server).pk, previous=regenerated_id, before=first_id
        )


def in_a_thread(work):
    """Run `work` (an ORM call) on a thread of its own: the ORM refuses Playwright's."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


@pytest.mark.parametrize(
    "viewport", [pytest.param(DESKTOP, id="1280x900"), pytest.param(PHONE, id="390x844")]
)
def test_the_model_list_offers_chat_aliases_live_and_errors_are_worded_for_a_person(
    daphne_server, tiny_alias, minilm_alias, staff_user, open_context, viewport
):
    """ADM-4: the list holds chat aliases only (not the embedding one) and follows the admin
    without a reload: an alias disabled since the page loaded leaves it. A turn on an alias that
    is gone says so in words (the code on a line of its own), with no Copy or Regenerate for
    the empty reply, and gives the input back."""
    from models_app.models import ModelAlias
    from tests.support import register_alias

    in_a_thread(lambda: register_alias(name="tiny-two", folder="tiny-llama"))
    page = signed_in_chat(open_context(viewport))
    options = "() => [...document.querySelectorAll('#chat-model option')].map(o => o.value)"
    assert page.evaluate(options) == ["tiny", "tiny-two"]  # minilm is an embedding model
    page.select_option("#chat-model", "tiny-two")

    in_a_thread(lambda: ModelAlias.objects.filter(name="tiny-two").update(enabled=False))
    page.wait_for_function(f"() => JSON.stringify(({options})()) === '[\"tiny\"]'", timeout=15_000)
    note = page.locator("#chat-model-note")
    assert note.inner_text() == "tiny-two is not offered any more (it was disabled or removed). Now: tiny."
    page.screenshot(path=str(ARTIFACTS / f"chat-alias-gone-{viewport['width']}.png"))

    # A page that still offers it (as one that loaded before the change would): the server says no.
    page.evaluate(
        "() => { const o = document.createElement('option'); o.value = o.textContent = 'tiny-two';"
        " document.querySelector('#chat-model').append(o); }"
    )
    page.select_option("#chat-model", "tiny-two")
    say(page, "Hello?")
    turn = finished_turn(page, 0)
    assert turn.get_attribute("data-status") == "failed"
    assert turn.locator(".chat-status").inner_text() == (
        "tiny-two is not offered for chat any more (it was disabled or removed). "
        "Pick another model and send again."
    )
    assert turn.locator(".chat-error-code").inner_text() == "404 \u00b7 model_not_found"
    assert turn.locator(".chat-copy").is_hidden() and turn.locator(".chat-regen").is_hidden()
    assert page.input_value("#chat-input") == "Hello?"  # given back, to send again
    page.wait_for_function(f"() => !({options})().includes('tiny-two')")  # the error re-read the list
    no_sideways_overflow(page, viewport["width"])
    page.screenshot(path=str(ARTIFACTS / f"chat-error-words-{viewport['width']}.png"))


def stored_response_page(page, pk: int, *, previous: str, before: str) -> None:
    """ADM-5: the stored turn's admin page shows the conversation, not JSON, and links its parent."""
    page.goto(f"/admin/models_app/storedresponse/{pk}/change/")
    section = page.locator(".mlxhost-transcript")
    assert section.locator(".mlxhost-status").inner_text() == "Stopped"
    roles = section.locator(".mlxhost-message .mlxhost-role").all_inner_texts()
    assert [r.split(" (")[0] for r in roles] == [
        "USER",
        "ASSISTANT",
        "USER",
        "ASSISTANT",
        "USER",
        "ASSISTANT",
    ]
    assert "Count to a thousand" in section.inner_text()
    section.locator(".mlxhost-previous a", has_text=previous).wait_for()
    page.screenshot(path=str(SCREENSHOTS / "stored-response.png"), full_page=True)
    page.click(f".mlxhost-previous a >> text={previous}")
    page.locator(".mlxhost-transcript .mlxhost-previous a", has_text=before).wait_for()  # one step back
    assert page.locator(".mlxhost-transcript .mlxhost-status").inner_text() == "Cut off at the token limit"


HOSTILE = (
    "Here is **bold**, `code` and a [safe link](https://example.com/x).\n\n"
    '<script>window.__xss = "script"</script>\n\n'
    '<img src="x" onerror="window.__xss = \'img\'">\n\n'
    "[click](javascript:window.__xss='link') and <a href=\"javascript:alert(1)\">raw</a>\n\n"
    "```python\n" + "print('a very long line that must scroll inside its own box') " * 4 + "\n```\n\n"
    "| a | b |\n|---|--:|\n| 1 | <b>2</b> |\n\n"
    "- one\n  - nested\n- two\n\n"
    "https://example.com/" + "a" * 120
)


def test_markup_in_a_reply_is_shown_as_text_and_never_runs(daphne_server, staff_user, open_context):
    """ADM-4: a reply with <script>, onerror and javascript: links renders inert at phone width
    (a mocked socket stands in for a model that would write them)."""

    def fake_model(ws) -> None:
        def answer(message) -> None:
            body = json.loads(message)
            if body.get("type") != "response.create":
                return
            response = {"id": "resp_fake", "status": "in_progress", "output": [], "usage": None}
            ws.send(json.dumps({"type": "response.created", "response": response, "session_cache": "fresh"}))
            for piece in (HOSTILE[:40], HOSTILE[40:]):
                ws.send(json.dumps({"type": "response.output_text.delta", "delta": piece}))
            usage = {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 90}
            done = {**response, "status": "completed", "usage": usage, "incomplete_details": None}
            timings = {"queue_ms": 1.0, "ttft_ms": 12.0, "prefill_tps": 100.0, "decode_tps": 50.0}
            ws.send(json.dumps({"type": "response.completed", "response": done, "timings": timings}))

        ws.on_message(answer)

    context = open_context(PHONE)
    page = context.new_page()
    page.route_web_socket(re.compile(r"/ws/v1/responses$"), fake_model)
    fake = {"name": "fake", "temperature": 0, "top_p": 1, "max_output_tokens": 64}
    page.route("**/dashboard/chat/aliases/", lambda route: route.fulfill(json={"aliases": [fake]}))
    page.goto("/admin/login/?next=/admin/")
    page.fill("#id_username", STAFF)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")
    page.goto("/dashboard/chat/")
    page.wait_for_selector('#chat-socket[data-state="open"]')
    page.evaluate(
        "() => { const o = document.createElement('option'); o.value = o.textContent = 'fake';"
        " document.querySelector('#chat-model').replaceChildren(o); }"
    )
    page.evaluate("document.querySelector('#chat-model').dispatchEvent(new Event('change'))")
    say(page, "Say something nasty")
    reply = finished_turn(page, 0).locator(".chat-md")
    text = reply.inner_text()
    assert '<script>window.__xss = "script"</script>' in text
    assert "onerror=" in text and "javascript:window.__xss" in text
    assert reply.locator("script, img, iframe, object").count() == 0
    assert reply.locator("a").count() == 2  # the https link and the bare URL
    for href in reply.locator("a").evaluate_all("links => links.map(a => a.href)"):
        assert href.startswith("https://example.com/"), href
    assert (
        reply.evaluate(
            "node => [...node.querySelectorAll('*')].flatMap(e => [...e.attributes])"
            ".filter(a => a.name.startsWith('on')).length"
        )
        == 0
    )
    assert reply.locator("strong").inner_text() == "bold"
    assert reply.locator("pre code.language-python").count() == 1
    # Code reads at full contrast and a reading size, and copies on its own.
    size, color, body = reply.locator("pre code").evaluate(
        "c => [parseFloat(getComputedStyle(c).fontSize), getComputedStyle(c).color,"
        " getComputedStyle(document.body).color]"
    )
    assert size >= 13 and color == body, (size, color, body)
    reply.locator(".chat-code-copy").click()
    reply.locator(".chat-code-copy", has_text="Copied").wait_for()
    assert page.evaluate("navigator.clipboard.readText()").startswith("print('a very long line")
    assert reply.locator(".md-table td.md-right").inner_text() == "<b>2</b>"
    assert reply.locator("ul > li > ul > li").inner_text() == "nested"
    assert page.evaluate("window.__xss") is None
    no_sideways_overflow(page, PHONE["width"])
    send_in_view(page, PHONE["height"])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    reply.screenshot(path=str(ARTIFACTS / "chat-markdown.png"))  # for a look, never in the docs

    # The renderer on its own: HTML never becomes elements, only text.
    html = page.evaluate(
        "md => { const d = document.createElement('div'); d.append(window.mlxhostMarkdown.render(md));"
        " return d.innerHTML; }",
        "<svg onload=alert(1)> *em* [x](data:text/html,hi) [y](/relative) \\*literal\\*",
    )
    assert html == (
        "<p>&lt;svg onload=alert(1)&gt; <em>em</em> [x](data:text/html,hi) [y](/relative) *literal*</p>"
    )
