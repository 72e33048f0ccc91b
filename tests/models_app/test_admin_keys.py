"""The admin's API key and usage pages (KEY-1, KEY-3, KEY-4): the secret shown once with snippets,
revoking, limits, last use, usage by day per key and per user with a chart and a CSV export."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import date, timedelta

import pytest
from django.utils import timezone

from models_app.accounting.snippets import key_snippets
from models_app.catalogue import hotcache, services
from models_app.models import ApiKey, UsageDay

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

KEYS = "/admin/models_app/apikey/"
USAGE = "/admin/models_app/usageday/"
RAW_KEY = re.compile(r"mlxh_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{20,}")
SCRIPT = re.compile(r"<script\b([^>]*)>", re.IGNORECASE)


def no_inline_script(page: str) -> bool:
    """Every <script> loads a file or is a JSON data block: the admin's CSP allows nothing else."""
    return all("src=" in attrs or 'type="application/json"' in attrs for attrs in SCRIPT.findall(page))


def create_key(client, owner, **fields) -> tuple[ApiKey, str]:
    body = {"owner": owner.pk, "name": "laptop", "requests_per_minute": "", "tokens_per_day": "", **fields}
    response = client.post(f"{KEYS}add/", body)
    assert response.status_code == 302, response.content.decode()[:3000]
    key = ApiKey.objects.get(name=body["name"])
    assert response["Location"] == f"{KEYS}{key.pk}/created/"
    return key, response["Location"]


def test_a_new_key_is_shown_once_with_copy_buttons_and_snippets(admin_client, admin_user, tiny_alias):
    """KEY-1: after creation one page shows the secret, a copy button for it and for each snippet
    (curl, OpenAI SDK, Anthropic SDK, the agent CLIs' environment); loading it again shows nothing."""
    key, created = create_key(admin_client, admin_user, requests_per_minute="60", tokens_per_day="100000")
    page = admin_client.get(created).content.decode()
    [raw] = set(RAW_KEY.findall(page))
    assert raw.startswith(key.prefix) and key.secret_hash not in page
    assert 'data-copy="mlxhost-secret"' in page
    for snippet in ("tiny-curl", "tiny-openai", "tiny-anthropic", "env"):
        assert f'data-copy="snippet-{snippet}"' in page
    base = "http://testserver"
    for expected in (
        f"curl {base}/v1/chat/completions",
        f"openai.OpenAI(base_url=&quot;{base}/v1&quot;, api_key=&quot;{raw}&quot;)",
        f"anthropic.Anthropic(base_url=&quot;{base}&quot;, api_key=&quot;{raw}&quot;)",
        f"export OPENAI_BASE_URL={base}/v1",
        f"export OPENAI_API_KEY={raw}",
        f"export ANTHROPIC_BASE_URL={base}",
        f"export ANTHROPIC_API_KEY={raw}",
        "&quot;model&quot;: &quot;tiny&quot;",  # the first enabled alias
    ):
        assert expected in page, expected
    assert "mlxhost/apikeys.js" in page and no_inline_script(page)
    assert (key.requests_per_minute, key.tokens_per_day) == (60, 100_000)

    again = admin_client.get(created).content.decode()
    assert not RAW_KEY.search(again)
    assert "shown once" in again
    for url in (KEYS, f"{KEYS}{key.pk}/change/"):
        assert raw not in admin_client.get(url).content.decode()


def test_the_snippets_name_a_chat_alias_first_and_embeddings_their_endpoint(
    admin_client, admin_user, tiny_alias, minilm_alias
):
    """KEY-1: with an embedding alias that sorts first (minilm < tiny), the snippets shown first
    name the chat alias; a picker offers both, and the embedding alias's call /v1/embeddings."""
    _, created = create_key(admin_client, admin_user)
    page = admin_client.get(created).content.decode()
    groups = re.findall(r'<div class="mlxhost-snippet-group" data-alias="([^"]+)"( hidden)?>', page)
    assert groups == [("tiny", ""), ("minilm", " hidden")]
    assert '<option value="tiny">tiny</option><option value="minilm">minilm (embedding)</option>' in page
    minilm = page[page.index('data-alias="minilm"') :]
    assert "/v1/embeddings" in minilm and "/v1/chat/completions" not in minilm
    assert 'id="snippet-minilm-anthropic"' not in page  # Anthropic's API has no embeddings
    tiny = page[page.index('data-alias="tiny"') : page.index('data-alias="minilm"')]
    assert "/v1/chat/completions" in tiny and "/v1/embeddings" not in tiny


def test_the_owner_of_a_new_key_starts_on_the_signed_in_user(admin_client, admin_user, user):
    page = admin_client.get(f"{KEYS}add/").content.decode()
    assert f'<option value="{admin_user.pk}" selected>' in page
    assert f'<option value="{user.pk}" selected>' not in page


def test_embedding_snippets_call_the_embeddings_endpoint():
    snippets = {
        s.id: s.text
        for s in key_snippets(base_url="https://llm.example/", raw_key="K", model="e", embedding=True)
    }
    assert list(snippets) == ["curl", "openai", "env"]
    assert snippets["curl"].splitlines()[0] == "curl https://llm.example/v1/embeddings \\"
    assert json.loads(snippets["curl"].split("-d '")[1].rstrip("'")) == {"model": "e", "input": ["Hello"]}
    compile(snippets["openai"], "openai", "exec")
    assert 'client.embeddings.create(model="e"' in snippets["openai"]


def test_snippets_name_the_server_and_the_key():
    snippets = {s.id: s.text for s in key_snippets(base_url="https://llm.example/", raw_key="K", model="m")}
    assert snippets["curl"].splitlines()[0] == "curl https://llm.example/v1/chat/completions \\"
    assert '-H "Authorization: Bearer K"' in snippets["curl"]
    assert json.loads(snippets["curl"].split("-d '")[1].rstrip("'"))["model"] == "m"
    compile(snippets["openai"], "openai", "exec")  # valid Python
    compile(snippets["anthropic"], "anthropic", "exec")
    assert snippets["env"].splitlines() == [
        "export OPENAI_BASE_URL=https://llm.example/v1",
        "export OPENAI_API_KEY=K",
        "export ANTHROPIC_BASE_URL=https://llm.example",
        "export ANTHROPIC_API_KEY=K",
    ]


def test_revoking_asks_first_then_says_so_and_the_list_shows_a_badge(admin_client, user):
    """KEY-1: the list's action and the key page's button ask first (a page naming the key; nothing
    revoked yet), then revoke, say so in a success message, and the list marks the key "revoked";
    a revoked key's page offers no button."""
    first, _ = services.apikey_create(owner=user, name="first")
    second, _ = services.apikey_create(owner=user, name="second")
    asked = admin_client.post(KEYS, {"action": "revoke", "_selected_action": [first.pk]})
    page = asked.content.decode()
    assert asked.status_code == 200 and "Revoke this key?" in page and f"{first.prefix}…" in page
    assert 'name="confirmed" value="1"' in page and 'name="action" value="revoke"' in page
    assert not ApiKey.objects.filter(revoked_at__isnull=False).exists()
    response = admin_client.post(
        KEYS, {"action": "revoke", "_selected_action": [first.pk], "confirmed": "1"}, follow=True
    )
    page = response.content.decode()
    assert "Revoked first (" in page and "now get 401" in page
    assert 'class="messagelist"' in page and 'class="success"' in page
    assert page.count("mlxhost-badge-revoked") == 1 and page.count("mlxhost-badge-active") == 1

    change = f"{KEYS}{second.pk}/change/"
    assert f'href="{KEYS}{second.pk}/revoke/"' in admin_client.get(change).content.decode()
    for unconfirmed in (admin_client.get, admin_client.post):
        asked = unconfirmed(f"{KEYS}{second.pk}/revoke/")
        assert asked.status_code == 200 and "Revoke this key?" in asked.content.decode()
        assert f'href="{change}"' in asked.content.decode()  # "No, keep it" goes back
    assert ApiKey.objects.filter(revoked_at__isnull=False).count() == 1
    response = admin_client.post(f"{KEYS}{second.pk}/revoke/", {"confirmed": "1"}, follow=True)
    page = response.content.decode()
    assert "Revoked second (" in page and "mlxhost-badge-revoked" in page
    assert "/revoke/" not in page
    assert ApiKey.objects.filter(revoked_at__isnull=False).count() == 2

    again = admin_client.post(KEYS, {"action": "revoke", "_selected_action": [first.pk]}, follow=True)
    assert "revoked already" in again.content.decode()
    revoked = admin_client.get(f"{KEYS}?status=revoked").content.decode()
    assert "first" in revoked and "second" in revoked


def test_the_list_shows_last_use_limits_and_recent_tokens(admin_client, user):
    """KEY-1, KEY-3: last use in words, the limits, and the last 30 days' tokens linking to usage."""
    key, _ = services.apikey_create(owner=user, name="busy", requests_per_minute=120)
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now() - timedelta(minutes=5))
    today = timezone.now().date()
    UsageDay.objects.create(day=today, owner=user, key=key, requests=3, prompt_tokens=1000, output_tokens=234)
    UsageDay.objects.create(day=today - timedelta(days=40), owner=user, key=key, prompt_tokens=9)  # too old
    services.apikey_create(owner=user, name="idle")
    page = admin_client.get(KEYS).content.decode()
    assert "5\xa0minutes ago" in page and "never" in page
    assert "120 requests/min" in page
    assert f'<a href="{USAGE}?key__id__exact={key.pk}">1,234</a>' in page


def test_editing_limits_applies_at_once(admin_client, user):
    """KEY-4: a key's page edits its name and limits; the cached identity is dropped at once."""
    key, _ = services.apikey_create(owner=user, name="ci")
    hotcache.api_keys.put("anything", None, hotcache.api_keys.generation)
    response = admin_client.post(
        f"{KEYS}{key.pk}/change/", {"name": "ci-2", "requests_per_minute": "5", "tokens_per_day": ""}
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    key.refresh_from_db()
    assert (key.name, key.requests_per_minute, key.tokens_per_day) == ("ci-2", 5, None)
    assert hotcache.api_keys.get("anything") is hotcache.MISS
    bad = admin_client.post(f"{KEYS}{key.pk}/change/", {"name": "ci", "requests_per_minute": "0"})
    assert bad.status_code == 200 and "requests_per_minute" in bad.context["adminform"].form.errors


def usage_rows(user, django_user_model):
    bob = django_user_model.objects.create_user(username="bob", password="pw-bob-123")
    alice_key, _ = services.apikey_create(owner=user, name="alice-laptop")
    bob_key, _ = services.apikey_create(owner=bob, name="bob-ci")
    today = timezone.now().date()
    for days_ago, key, prompt, output in (
        (0, alice_key, 100, 10),
        (1, alice_key, 200, 20),
        (0, bob_key, 1000, 100),
    ):
        UsageDay.objects.create(
            day=today - timedelta(days=days_ago),
            owner=key.owner,
            key=key,
            requests=1,
            prompt_tokens=prompt,
            output_tokens=output,
        )
    UsageDay.objects.create(day=today, owner=user, key=None, requests=2, prompt_tokens=5, output_tokens=5)
    return alice_key, bob_key, bob


def chart_data(page: str, chart_id: str) -> dict:
    match = re.search(rf'<script id="{chart_id}" type="application/json">(.*?)</script>', page, re.S)
    assert match, f"no {chart_id} data block"
    return json.loads(match.group(1))


def test_usage_by_day_per_user_and_per_key_with_a_chart_and_csv(admin_client, user, django_user_model):
    """KEY-3: the usage page sums the filtered rows per day (chart and table), per user, and
    exports the same rows as CSV; filtering by a user gives that user's totals by day, by a key
    that key's."""
    alice_key, _, bob = usage_rows(user, django_user_model)
    page = admin_client.get(USAGE).content.decode()
    assert no_inline_script(page) and "mlxhost/usage.js" in page and "uPlot.iife.min.js" in page
    everything = chart_data(page, "mlxhost-usage-chart")
    assert everything["prompt"] == [200, 1105] and everything["output"] == [20, 115]
    assert page.index(">bob</a>") < page.index(">alice</a>")  # per-user totals, heaviest first
    assert "browser session" in page

    alice = admin_client.get(f"{USAGE}?owner__id__exact={user.pk}").content.decode()
    assert chart_data(alice, "mlxhost-usage-chart")["prompt"] == [200, 105]  # the key and the session
    only_key = admin_client.get(f"{USAGE}?key__id__exact={alice_key.pk}").content.decode()
    assert chart_data(only_key, "mlxhost-usage-chart")["prompt"] == [200, 100]
    assert f'href="{USAGE}export.csv?key__id__exact={alice_key.pk}"' in only_key

    response = admin_client.get(f"{USAGE}export.csv?owner__id__exact={bob.pk}")
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"].startswith('attachment; filename="mlxhost-usage-')
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [(r["user"], r["key"], r["prompt_tokens"], r["total_tokens"]) for r in rows] == [
        ("bob", "bob-ci", "1000", "1100")
    ]
    assert (
        len(
            list(
                csv.reader(
                    io.StringIO(b"".join(admin_client.get(f"{USAGE}export.csv").streaming_content).decode())
                )
            )
        )
        == 5
    )

    assert admin_client.get(f"{USAGE}add/").status_code == 403
    row = UsageDay.objects.first()
    assert admin_client.post(f"{USAGE}{row.pk}/delete/").status_code == 403


def test_a_keys_page_shows_its_last_30_days_and_links_to_its_usage(admin_client, user, django_user_model):
    """KEY-3: the key page has its own chart and daily table, and links to the key's and the
    owner's usage by day."""
    alice_key, _, _ = usage_rows(user, django_user_model)
    page = admin_client.get(f"{KEYS}{alice_key.pk}/change/").content.decode()
    assert chart_data(page, "mlxhost-key-usage")["prompt"] == [200, 100]
    assert f"{USAGE}?key__id__exact={alice_key.pk}" in page
    assert f"{USAGE}?owner__id__exact={user.pk}" in page
    assert no_inline_script(page)
    today = date.today().isoformat()
    assert today[:4] in page  # the daily table's dates


def test_a_user_who_is_not_staff_cannot_reach_the_key_pages(client, user):
    key, _ = services.apikey_create(owner=user, name="k")
    client.force_login(user)
    for url in (KEYS, f"{KEYS}{key.pk}/created/", f"{USAGE}export.csv"):
        response = client.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"], url


def test_refused_requests_and_counts_show_on_the_key_page_the_usage_page_and_the_csv(
    admin_client, user, django_user_model
):
    """KEY-3: a day's refusals (by the key's limits, by a busy model) and count_tokens calls are
    on the key's page, in the usage page's daily sums and its rows, and in the CSV."""
    key, _ = services.apikey_create(owner=user, name="agent")
    UsageDay.objects.create(
        day=timezone.now().date(),
        owner=user,
        key=key,
        requests=3,
        prompt_tokens=30,
        count_requests=11,
        rate_limited=7,
        overloaded=5,
    )
    page = admin_client.get(f"{KEYS}{key.pk}/change/").content.decode()
    # Each header names what it counts (issue 25 §7: "Counts" said nothing); each cell carries its
    # header as data-label, for the phone's stacked layout.
    for header in ("Token-count calls", "Rate-limited", "Overloaded"):
        assert f">{header}</th>" in page
    assert ">Counts</th>" not in page
    cells = re.findall(r'<td class="mlxhost-num" data-label="[^"]+">(\d+)</td>', page)
    assert cells[-3:] == ["11", "7", "5"]  # the totals row ends with them

    listing = admin_client.get(USAGE).content.decode()
    assert 'title="7 over the key\'s limits, 5 by a busy model">12</span>' in listing
    rows = list(
        csv.DictReader(
            io.StringIO(b"".join(admin_client.get(f"{USAGE}export.csv").streaming_content).decode())
        )
    )
    assert [(r["count_requests"], r["rate_limited"], r["overloaded"]) for r in rows] == [("11", "7", "5")]
