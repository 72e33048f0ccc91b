"""The chat page's view: who may open it, what it renders, its hardening, and reopening a stored
conversation (ADM-4, API-5, PER-6). The page in a browser: tests/e2e/test_chat_page.py."""

from __future__ import annotations

import json
import re

import pytest

from models_app.models import ModelAlias
from tests.models_app.test_transcripts import stored
from tests.support import register_alias

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

URL = "/dashboard/chat/"


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user(username="ops", password="pw-ops-123", is_staff=True)


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


@pytest.fixture
def tiny_chat(tiny_model_dir):
    return register_alias(name="tiny-chat", folder="tiny-llama", temperature=0.3)


def history_of(page: str):
    island = re.search(r'<script id="chat-history" type="application/json">(.*?)</script>', page, flags=re.S)
    assert island, "no chat-history data island"
    return json.loads(island.group(1))


def test_anonymous_visitors_are_sent_to_the_admin_login(client):
    """API-5: browser pages use Django sessions."""
    response = client.get(URL)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/") and f"next={URL}" in response["Location"]


def test_signed_in_non_staff_users_are_refused(client, user):
    """ADM-4: the chat page is for staff only."""
    client.force_login(user)
    assert client.get(URL).status_code == 403


def test_only_safe_methods_are_served(staff_client):
    """ADM-4: turns go over the WebSocket; the page itself only answers GET and HEAD."""
    assert staff_client.post(URL).status_code == 405


def test_staff_get_the_enabled_aliases_and_an_empty_conversation(staff_client, tiny_chat):
    """ADM-4: the alias picker lists enabled aliases with their defaults; no history yet."""
    register_alias(name="tiny-off", folder="tiny-llama", enabled=False)
    response = staff_client.get(URL)
    assert response.status_code == 200
    page = response.content.decode()
    assert '<option value="tiny-chat" data-temperature="0.3"' in page
    assert 'value="tiny-off"' not in page
    assert 'data-ws-path="/ws/v1/responses"' in page
    assert history_of(page) is None
    assert "None stored yet." in page
    for words in ("Queue", "First token", "Tokens/s", "Cache", "What the figures mean"):
        assert words in page


def test_the_model_list_holds_chat_aliases_only_and_is_served_live(staff_client, tiny_chat, minilm_alias):
    """ADM-4: an embedding alias is not offered for chat, on the page or in the list the page
    re-reads to stay live (which follows the admin: a disabled alias leaves it)."""
    page = staff_client.get(URL).content.decode()
    assert 'value="tiny-chat"' in page and 'value="minilm"' not in page
    assert 'data-aliases-url="/dashboard/chat/aliases/"' in page
    listed = staff_client.get("/dashboard/chat/aliases/", headers={"Accept": "application/json"})
    assert listed.json() == {
        "aliases": [{"name": "tiny-chat", "temperature": 0.3, "top_p": 1.0, "max_output_tokens": 512}]
    }
    ModelAlias.objects.filter(name="tiny-chat").update(enabled=False)
    assert staff_client.get("/dashboard/chat/aliases/").json() == {"aliases": []}


def test_the_live_model_list_is_for_staff(client, user):
    assert client.get("/dashboard/chat/aliases/", headers={"Accept": "application/json"}).status_code == 401
    client.force_login(user)
    assert client.get("/dashboard/chat/aliases/").status_code == 403


def test_the_page_runs_under_the_strict_policy(staff_client, tiny_chat):
    """API-5: scripts and styles from this site only, no inline code; the socket's origins allowed."""
    response = staff_client.get(URL)
    page = response.content.decode()
    sources = re.findall(r"<script\b[^>]*\bsrc=\"([^\"]+)\"", page)
    for name in ("mlxhost/chat.js", "mlxhost/markdown.js", "mlxhost/dashboard.js"):
        assert any(src.endswith(name) for src in sources), name
    assert all(src.startswith("/static/") for src in sources), sources
    for tag in re.findall(r"<script\b[^>]*>", page):
        assert "src=" in tag or 'type="application/json"' in tag, tag
    assert not re.search(r"\son[a-z]+=", page), "inline event handler"
    assert not re.search(r"\sstyle=", page), "inline style"
    csp = response["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "connect-src 'self' ws://testserver wss://testserver" in csp
    assert response["X-Frame-Options"] == "DENY"
    forms = re.findall(r"<form\b.*?</form>", page, flags=re.S)
    assert any('id="chat-form"' in form for form in forms)
    for form in forms:
        assert 'name="csrfmiddlewaretoken"' in form


def test_a_stored_conversation_reopens_by_its_last_id(staff_client, staff, tiny_chat):
    """ADM-4: ?response=<id> renders the chain's turns for the page to show and continue."""
    stored(staff, "resp_a", said="first question", answered="first answer")
    stored(staff, "resp_b", previous="resp_a", said="second <question>", answered="second answer")
    page = staff_client.get(URL, {"response": "resp_b"}).content.decode()
    history = history_of(page)
    assert [t["id"] for t in history["turns"]] == ["resp_a", "resp_b"]
    assert history["turns"][1]["input"] == "second <question>"  # data, escaped in the island
    assert "second <question>" not in page
    # The sidebar: the conversation once, by its opening words, linking its newest turn.
    assert 'aria-current="page" data-root="resp_a"><a href="?response=resp_b">first question</a>' in page
    # Which reply it continues, as a person reads it: words and a short id, the full id in a title.
    tip = re.search(r'<p id="chat-conversation"[^>]*>(.*?)</p>', page, re.S)
    assert tip and 'data-response="resp_b"' in tip.group(0), page
    assert tip.group(1).startswith("Continues a previous reply <a ") and 'title="resp_b"' in tip.group(1)
    # One rule for "how long ago" (models_app/console/words.py): never "0 minutes ago".
    assert "0\xa0minutes" not in page and ("just now" in page or "\xa0seconds ago" in page)


def test_another_users_conversation_is_a_404_like_a_missing_one(staff_client, django_user_model):
    """PER-6: someone else's id and an unknown id answer the same: a 404 page with a new chat."""
    bob = django_user_model.objects.create_user(username="bob", password="pw-bob-123", is_staff=True)
    stored(bob, "resp_bobs", said="bob's secret", answered="hidden")
    answers = []
    for public_id in ("resp_bobs", "resp_nothing"):
        response = staff_client.get(URL, {"response": public_id})
        page = response.content.decode()
        assert response.status_code == 404
        assert history_of(page) is None and "bob's secret" not in page
        assert "is not stored for you" in page
        answers.append(page.replace(public_id, "ID"))
    assert re.sub(r'name="csrfmiddlewaretoken" value="[^"]+"', "", answers[0]) == re.sub(
        r'name="csrfmiddlewaretoken" value="[^"]+"', "", answers[1]
    )
