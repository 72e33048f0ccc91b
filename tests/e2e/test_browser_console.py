"""The console as a new staff user sees it (issue 25 §7), in headless Chromium at a laptop's
1280x900 and a phone's 390x844: the conversation chain page fits and its input and output are
readable; the stored responses list previews each turn with its answer as Markdown (inert) and
links it to the chat page. Screenshots land in .cache/artifacts/ (git-ignored)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest

from tests.e2e.test_browser import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    WAIT_MS,
    _console_error,
    _require_browser,
    sign_in,
    staff_user,  # noqa: F401  (a fixture)
)

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

VIEWPORTS = {"laptop": (1280, 900), "phone": (390, 844)}
LONG_INPUT = (
    "Please explain, in a few careful sentences, why the sky looks blue at noon but red at dusk. " * 3
)
ANSWER = (
    "Sunlight is **scattered** by the air: short (blue) wavelengths scatter most.\n\n"
    "```python\nprint('rayleigh')\n```\n\n<img src=x onerror=\"window.__xss = 1\">"
)
OVERFLOW = "document.documentElement.scrollWidth - window.innerWidth"


@pytest.fixture
def chain(staff_user):  # noqa: F811
    """Three turns of the staff member's, each with a long input and a Markdown answer."""
    from tests.models_app.test_admin import _stored

    rows, previous = [], ""
    for n in range(1, 4):
        public_id = f"resp_console{n}"
        rows.append(_stored(staff_user, public_id, previous=previous, text_in=LONG_INPUT, text_out=ANSWER))
        previous = public_id
    return rows


def signed_in_pages(url: str, errors: list[str]) -> Iterator[tuple[str, int, Any]]:
    """A staff-signed-in page at each of VIEWPORTS, each in a fresh context, collecting the pages'
    script and console errors into `errors`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for device, (width, height) in VIEWPORTS.items():
                context = browser.new_context(base_url=url, viewport={"width": width, "height": height})
                context.set_default_timeout(WAIT_MS)
                context.on("weberror", lambda error: errors.append(str(error.error)))
                context.on("console", lambda message: _console_error(message, errors))
                page = context.new_page()
                sign_in(page)
                yield device, width, page
                context.close()
        finally:
            browser.close()


def test_the_chain_page_and_the_stored_responses_list_read_well(daphne_server, staff_user, chain):  # noqa: F811
    """ADM-5, ADM-9: the chain page is as wide as the window at 390 px, its input and output are
    at least 300 px wide there and 450 px at 1280 px (not one word per line); the list shows a
    preview with the answer rendered as Markdown, where markup never runs, and a link that
    reopens the conversation in the chat page."""
    _require_browser()

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for device, width, page in signed_in_pages(daphne_server.url, errors):
        chain_page(page, device, width, chain[-1].pk)
        stored_list(page, device, width)
        chat_words(page)
    assert not errors, f"errors in the pages: {errors}"


def chat_words(page) -> None:
    """Issue 25 §7: the chat page says which reply it continues in words, with a short id (the full
    one in its title), and the sidebar and the scripts say how long ago by one rule (words.py)."""
    page.goto("/dashboard/chat/?response=resp_console3")
    tip = page.locator("#chat-conversation")
    page.locator("#chat-transcript li.chat-turn").nth(2).wait_for()
    assert tip.inner_text() == "Continues a previous reply resp_console3", tip.inner_text()
    assert tip.locator("a").get_attribute("title") == "resp_console3"
    meta = page.locator("#chat-recent .chat-recent-meta").first.inner_text()
    assert "0\xa0minutes" not in meta and re.search(r"just now|\d+\xa0seconds ago$", meta), meta
    said = page.evaluate("[0, 4, 12, 60, 3 * 3600 + 5].map(window.mlxhost.ago)")
    assert said == ["just now", "just now", "12\xa0seconds ago", "1\xa0minute ago", "3\xa0hours ago"], said


def chain_page(page, device: str, width: int, pk: int) -> None:
    page.goto(f"/admin/models_app/storedresponse/{pk}/chain/")
    assert page.evaluate(OVERFLOW) <= 0, f"the chain page scrolls sideways at {width} px"
    assert page.locator(".mlxhost-chain-turn").count() == 3
    widths = page.locator(".mlxhost-chain-io .mlxhost-text").evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().width)"
    )
    least = 300 if width < 500 else 450
    assert len(widths) == 6 and min(widths) >= least, widths
    page.screenshot(path=str(ARTIFACTS / f"chain-{device}.png"), full_page=True)


def stored_list(page, device: str, width: int) -> None:
    page.goto("/admin/models_app/storedresponse/")
    assert page.evaluate(OVERFLOW) <= 0, f"the stored responses list scrolls sideways at {width} px"
    row = page.locator("#result_list tbody tr", has_text="resp_console3")
    assert row.locator(".mlxhost-preview-prompt").inner_text().startswith("Please explain")
    if width < 500:  # the id yields its width to the preview on a phone (issue 25 §7)
        id_width = row.locator(".field-public_id").evaluate("e => e.getBoundingClientRect().width")
        preview_width = row.locator(".mlxhost-preview").evaluate("e => e.getBoundingClientRect().width")
        assert id_width <= 100 and preview_width >= 2 * id_width, (id_width, preview_width)
    answer = row.locator(".mlxhost-preview-answer")
    assert answer.locator("strong").inner_text() == "scattered"  # Markdown, rendered
    assert answer.locator("img, script").count() == 0 and page.evaluate("window.__xss") is None
    page.screenshot(path=str(ARTIFACTS / f"stored-list-{device}.png"), full_page=True)
    row.locator("a.mlxhost-continue").click()
    page.wait_for_url(re.compile(r"/dashboard/chat/\?response=resp_console3$"))
    page.locator("#chat-transcript li.chat-turn").nth(2).wait_for()  # the conversation, reopened
    assert page.locator("#chat-transcript li.chat-turn").count() == 3


@pytest.fixture
def one_day_of_usage(staff_user):  # noqa: F811
    from django.utils import timezone

    from models_app.catalogue import services
    from models_app.models import UsageDay

    key, _ = services.apikey_create(owner=staff_user, name="new")
    UsageDay.objects.create(
        day=timezone.now().date(),
        owner=staff_user,
        key=key,
        requests=3,
        prompt_tokens=12_345,
        cached_tokens=4_000,
        output_tokens=2_100,
    )
    return key


CHART = """() => { const box = document.querySelector('#mlxhost-usage-chart-section .mlxhost-usage-chart, .mlxhost-usage-chart');
  const u = box.mlxhostChart; const t = u.data[0][0];
  return { x: u.valToPos(t, 'x') / u.over.clientWidth,
           labels: u.axes.map(a => a.label),
           ticks: u.axes.flatMap(a => a._values || []),
           series: u.series.slice(1).map(s => s.label), drawn: box.mlxhostDrawn,
           note: (box.parentElement.querySelector('.mlxhost-chart-note') || {}).textContent || '' }; }"""
# uPlot draws its axes on a canvas
TABLE = """() => [...document.querySelectorAll('.mlxhost-usage-table')].map(t => ({
  overflow: t.parentElement.scrollWidth - t.parentElement.clientWidth,
  headers: [...t.querySelectorAll('thead th')].map(th => th.textContent) }))"""


def test_one_day_of_usage_is_a_readable_chart(daphne_server, staff_user, one_day_of_usage):  # noqa: F811
    """KEY-3: with one day of data the usage chart spans a week ending on it: the day's bars sit at
    its date, inside the plot (not at the left edge), under labelled axes (day in UTC, tokens,
    refused requests) whose values are short ("12k"). Issue 25 §7: every token series is a filled
    bar (the cached one is not a lone dot), a series that is zero on every day is said in a note,
    and the daily table fits a phone without scrolling sideways (it stacks), its headers naming
    what they count."""
    _require_browser()
    from django.utils import timezone

    today = timezone.now().date()
    errors: list[str] = []
    for device, width, page in signed_in_pages(daphne_server.url, errors):
        for url in (
            "/admin/models_app/usageday/",
            f"/admin/models_app/apikey/{one_day_of_usage.pk}/change/",
        ):
            page.goto(url)
            page.locator(".mlxhost-usage-chart .uplot").wait_for()
            chart = page.evaluate(CHART)
            assert 0.5 < chart["x"] < 0.99, chart  # in the plot, not on its left edge
            assert "day (UTC)" in chart["labels"] and "tokens" in chart["labels"], chart
            assert f"{today.month}/{today.day}" in chart["ticks"], chart
            assert any(tick.endswith("k") for tick in chart["ticks"]), chart
            assert "refused requests" in chart["labels"], chart
            assert chart["series"] == [
                "prompt tokens",
                "of which cached",
                "output tokens",
                "refused requests",
            ]
            # Bars, not a lone dot for one day; refusals a marked point on an axis of their own.
            assert chart["drawn"] == dict(zip(chart["series"], ["bar", "bar", "bar", "points"], strict=True))
            assert chart["note"] == "No refused requests on these days.", chart
            for table in page.evaluate(TABLE):
                assert "Counts" not in table["headers"], table
                if width < 500:
                    assert table["overflow"] <= 0, table  # stacked: no sideways scroll on a phone
            assert page.evaluate(OVERFLOW) <= 0
            page.screenshot(
                path=str(ARTIFACTS / f"usage-one-day-{device}-{url.split('/')[3]}.png"), full_page=True
            )
    assert not errors, f"errors in the pages: {errors}"


@pytest.fixture
def pinned_tiny(tiny_model_dir):
    """A tiny model, for the dashboard to chart once it is loaded."""
    from tests.support import register_alias

    return register_alias(name="tiny-pinned", folder="tiny-llama", temperature=0.0)


HISTORY_ISLAND = re.compile(r'<script id="status-history" type="application/json">(.*?)</script>', re.S)


def server_samples(page) -> int:
    """How many chart samples the server holds for its engines (read as a new page would get them)."""
    import json

    island = HISTORY_ISLAND.search(page.request.get("/dashboard/").text())
    history = json.loads(island.group(1)) if island else {}
    return max((sum(1 for s in samples if s["instances"]) for samples in history.values()), default=0)


def test_a_dashboard_opened_later_shows_the_last_hour_and_a_phone_picks_a_chart(
    daphne_server,
    staff_user,  # noqa: F811
    pinned_tiny,
):
    """ADM-2: the server keeps the charts' samples, so a dashboard opened later starts with them
    (not one point); on a phone one kind of chart shows for every instance, picked from a list."""
    _require_browser()

    errors: list[str] = []
    for device, _width, page in signed_in_pages(daphne_server.url, errors):
        if device == "laptop":  # load it: the daphne process started before the row existed
            page.goto("/dashboard/models/")
            row = page.locator(f'#models-body tr[data-model="{pinned_tiny.model.name}"]')
            row.locator("button[value=load]:enabled").click()
            row.locator(".badge-resident").wait_for()
        deadline = 30
        while server_samples(page) < 3 and deadline:  # a sample every 5 s
            page.wait_for_timeout(1000)
            deadline -= 1
        held = server_samples(page)
        assert held >= 3, held
        page.goto("/dashboard/")
        card = page.locator(".chart-card").first
        try:
            card.wait_for(timeout=15_000)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "dashboard-history-failed.png"), full_page=True)
            grid = page.evaluate("document.getElementById('charts-grid').outerHTML.slice(0, 400)")
            raise AssertionError(f"no chart card: {grid} {page.inner_text('#ws-state')}; {errors}") from None
        assert int(card.get_attribute("data-points")) >= held  # the history, then live points
        visible = page.locator(".chart-card .chart:visible")
        if device == "phone":
            assert page.input_value("#chart-pick") == "0"
            assert visible.count() == page.locator(".chart-card").count()  # one per instance
            page.select_option("#chart-pick", "3")
            assert page.locator('.chart-card .chart[data-chart="3"]').first.is_visible()
            page.select_option("#chart-pick", "0")
        else:
            assert page.input_value("#chart-pick") == "all"
            assert visible.count() == 5 * page.locator(".chart-card").count()
        assert page.evaluate(OVERFLOW) <= 0
        page.screenshot(path=str(ARTIFACTS / f"dashboard-history-{device}.png"), full_page=True)
    assert not errors, f"errors in the pages: {errors}"


def test_the_model_pages_alias_table_scrolls_inside_its_box(daphne_server, staff_user, tiny_alias):  # noqa: F811
    """Item 3 of the newcomer walk: the inline alias columns are named as the alias form names
    them, and at 390 px the table scrolls sideways inside its box, the page itself as wide as
    the window, at 1280 px nothing scrolls."""
    _require_browser()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for device, width, page in signed_in_pages(daphne_server.url, errors):
        page.goto(f"/admin/models_app/model/{tiny_alias.model_id}/change/")
        box = page.locator("#aliases-group fieldset.module")
        headers = " ".join(box.locator("th").all_inner_texts()).lower()
        assert "default output tokens" in headers and "output token clamp" in headers, headers
        assert "max tokens" not in headers
        page.screenshot(path=str(ARTIFACTS / f"model-aliases-{device}.png"), full_page=True)
        assert page.evaluate(OVERFLOW) <= 0, device
        inner, outer = box.evaluate("el => [el.scrollWidth, el.clientWidth]")
        if width < 500:
            assert box.evaluate("el => getComputedStyle(el).overflowX") == "auto"
            assert inner > outer, (inner, outer)  # the rest is a scroll away, not cut off
    assert not errors, f"errors in the pages: {errors}"


def test_an_embedding_models_charts_and_cells_say_only_what_applies(
    daphne_server,
    staff_user,  # noqa: F811
    pinned_tiny,
    minilm_alias,
):
    """Items 5-6 of the newcomer walk: an embedding instance's tokens/s chart counts input tokens,
    its first-token and hit-rate charts say "Not applicable" (no canvas that can never draw), its
    tokens/s cells carry no empty title; memory ticks step by round values of the unit shown; the
    page and docs/console.md give the charts' window as the code keeps it (the last hour)."""
    _require_browser()
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "console.md").read_text()
    assert "last hour" in " ".join(docs.split()) and "five minutes" not in docs
    errors: list[str] = []
    for device, _width, page in signed_in_pages(daphne_server.url, errors):
        if device == "laptop":
            page.goto("/dashboard/models/")
            for model in (pinned_tiny.model.name, minilm_alias.model.name):
                row = page.locator(f'#models-body tr[data-model="{model}"]')
                row.locator("button[value=load]:enabled").click()
                row.locator(".badge-resident").wait_for()
            tps = page.locator(f'#models-body tr[data-model="{minilm_alias.model.name}"] .tps')
            assert tps.get_attribute("title") is None
        page.goto("/dashboard/")
        assert "the last hour" in page.inner_text("#charts")
        embedding = page.locator(".chart-card", has_text=minilm_alias.name)
        embedding.wait_for()
        for chart in ("2", "4"):
            box = embedding.locator(f'.chart[data-chart="{chart}"]')
            assert "Not applicable" in box.inner_text() and box.locator(".uplot").count() == 0
        assert "input" in embedding.locator('.chart[data-chart="0"]').inner_text()
        row = page.locator("#instances-body tr", has_text=minilm_alias.name)
        assert row.locator(".tps").get_attribute("title") is None
        assert page.locator('#instances-body [title=""]').count() == 0
        title = page.evaluate(
            "[window.mlxhost.speculationTitle({speculation_acceptance: 0.5, tokens_per_pass: 2}),"
            " window.mlxhost.speculationTitle({kind: 'embedding'})]"
        )
        assert "totals since the engine started" in title[0] and title[1] is None, title
        line = page.evaluate(
            "[window.mlxhost.speculationLine({speculation_drafted: 120, speculation_acceptance: 0.625,"
            " tokens_per_pass: 3.4}), window.mlxhost.speculationLine({speculation_drafted: 0}),"
            " window.mlxhost.speculationLine({kind: 'embedding'})]"
        )
        assert line == ["drafts: 63% of 120 accepted \u00b7 3.40/pass", None, None], line
        steps = page.evaluate("window.mlxhost.byteSteps().map(window.mlxhost.roundBytes)")
        assert "200 MB" in steps and "1 GB" in steps and not any("." in s for s in steps), steps
        assert page.evaluate(OVERFLOW) <= 0
        page.screenshot(path=str(ARTIFACTS / f"dashboard-embedding-{device}.png"), full_page=True)
    assert not errors, f"errors in the pages: {errors}"
