"""Stored responses read as conversations: the admin's search and detail page (ADM-5), and the chat
page's history and conversation list (ADM-4)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from models_app.models import StoredResponse
from models_app.turns import transcripts

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]

CHANGELIST = "/admin/models_app/storedresponse/"


def stored(owner, public_id: str, *, previous: str = "", said: str = "", answered: str = "", **fields):
    """A stored turn as the Responses service writes it: this turn's input, the conversation so far
    (the parent's copy plus this input), the output items and usage."""
    history: list[dict] = []
    if previous:
        parent = StoredResponse.objects.get(public_id=previous)
        history = [*parent.request["conversation"], {"role": "assistant", "content": parent.output_text}]
    own = [{"role": "user", "content": said}]
    request = {
        "input": own,
        "instructions": fields.pop("instructions", None),
        "conversation": [*history, *own],
        "max_output_tokens": fields.pop("max_output_tokens", None),
    }
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answered}]}
    return StoredResponse.objects.create(
        public_id=public_id,
        owner=owner,
        alias_name="tiny",
        instance_id=1,
        weights_fingerprint="f" * 64,
        boot_id="boot-a",
        previous_response_id=previous,
        request=request,
        output=[message],
        output_text=answered,
        usage=fields.pop(
            "usage",
            {
                "input_tokens": 30,
                "input_tokens_details": {"cached_tokens": 12},
                "output_tokens": 7,
                "total_tokens": 37,
            },
        ),
        status=fields.pop("status", StoredResponse.Status.COMPLETED),
        expires_at=timezone.now() + timedelta(days=1),
        **fields,
    )


@pytest.fixture
def chain(user):
    """A three-turn conversation of alice's: asked about zebras, then giraffes, then okapis."""
    first = stored(user, "resp_one", said="Tell me about zebras", answered="Zebras have stripes.")
    second = stored(
        user, "resp_two", previous="resp_one", said="And giraffes?", answered="Giraffes are tall."
    )
    third = stored(
        user,
        "resp_three",
        previous="resp_two",
        said="And okapis?",
        answered="Okapis are shy",
        status=StoredResponse.Status.INCOMPLETE,
        max_output_tokens=7,
        instructions="Answer briefly.",
    )
    return first, second, third


def search(client, query: str) -> str:
    return client.get(CHANGELIST, {"q": query}).content.decode()


@pytest.mark.parametrize(
    "query",
    [
        pytest.param("giraffes", id="prompt-word"),
        pytest.param("GIRAFFES", id="prompt-word-any-case"),
        pytest.param("tall", id="output-word"),
        pytest.param("giraffes tall", id="both"),
    ],
)
def test_stored_responses_are_found_by_a_word_of_the_prompt_or_the_output(admin_client, chain, query):
    """ADM-5: the admin search looks inside the JSON input (on SQLite and PostgreSQL) and the output."""
    page = search(admin_client, query)
    assert "resp_two" in page
    assert "resp_one" not in page and "resp_three" not in page


def test_the_search_matches_instructions_but_not_other_owners_or_json_keys(
    admin_client, chain, django_user_model
):
    """ADM-5: instructions are searchable, another owner's prompt is found as theirs, and a word
    nobody wrote finds nothing."""
    bob = django_user_model.objects.create_user(username="bob", password="pw-bob-123")
    stored(bob, "resp_bob", said="nothing about animals", answered="ok")
    assert "resp_three" in search(admin_client, "briefly")
    assert "resp_bob" in search(admin_client, "animals") and "resp_one" not in search(admin_client, "animals")
    assert "0 results" in search(admin_client, "zzzunmatched")
    # SQLite stores JSON with non-ASCII escaped; the word is found there as on PostgreSQL.
    stored(chain[0].owner, "resp_kaese", said="Ein Gespräch über Käse", answered="ok")
    for word in ("Gespräch", "über", "gespräch ein"):
        page = search(admin_client, word)
        assert "resp_kaese" in page and "resp_one" not in page, word


def test_the_detail_page_renders_the_conversation_with_a_link_to_the_previous_response(admin_client, chain):
    """ADM-5: role-labelled messages (earlier turns marked), the output, usage, status in words,
    and the parent's page one click away; the raw JSON is folded away below."""
    first, second, third = chain
    page = admin_client.get(f"{CHANGELIST}{third.pk}/change/").content.decode()
    conversation = page[page.index('class="mlxhost-transcript') : page.index("</section>")]
    order = [
        conversation.index(text)
        for text in (
            "Answer briefly.",
            "Tell me about zebras",
            "Zebras have stripes.",
            "And giraffes?",
            "Giraffes are tall.",
            "And okapis?",
            "Okapis are shy",
        )
    ]
    assert order == sorted(order)
    for label in ("Instructions", "User", "Assistant", "(earlier turn)", "Output"):
        assert label in conversation
    assert "Cut off at the token limit" in conversation  # 7 of max 7 output tokens
    assert "30 input tokens (12 cached), 7 output, 37 total" in conversation
    assert f'href="{CHANGELIST}{second.pk}/change/">resp_two</a>' in conversation
    assert "Raw JSON" in page and "collapse" in page
    assert page.index('class="mlxhost-transcript') < page.index("Raw JSON")

    parent = admin_client.get(f"{CHANGELIST}{second.pk}/change/").content.decode()
    assert f'href="{CHANGELIST}{first.pk}/change/">resp_one</a>' in parent
    assert f'href="{CHANGELIST}{third.pk}/change/">resp_three</a>' in parent  # continued by
    root = admin_client.get(f"{CHANGELIST}{first.pk}/change/").content.decode()
    assert "none: this is the first turn" in root


def test_the_detail_page_escapes_stored_text_and_says_when_the_parent_is_gone(admin_client, user):
    """ADM-5: stored text is shown, never interpreted; a parent that is not stored is named, unlinked."""
    row = StoredResponse.objects.create(  # as an older row: no conversation copy, no output items
        public_id="resp_orphan",
        owner=user,
        alias_name="tiny",
        instance_id=1,
        weights_fingerprint="f" * 64,
        boot_id="boot-a",
        previous_response_id="resp_expired",
        request={"input": [{"role": "user", "content": "<script>alert(1)</script>"}]},
        output_text='<img src=x onerror="alert(2)">',
        status=StoredResponse.Status.CANCELLED,
        expires_at=timezone.now() + timedelta(days=1),
    )
    page = admin_client.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=" in page
    assert "<code>resp_expired</code>" in page and "not stored" in page
    assert ">Stopped<" in page


def test_chat_history_is_the_owners_chain_with_ids_for_continuing(user, chain, django_user_model):
    """ADM-4, PER-6: the chat page reopens a conversation from its rows; another owner's id is None."""
    history = transcripts.chat_history(owner_id=user.pk, public_id="resp_three")
    assert history is not None
    assert history["id"] == "resp_three" and history["alias"] == "tiny" and history["continuable"]
    assert history["instructions"] == "Answer briefly."
    assert [(t["id"], t["previous_id"], t["input"], t["output"]) for t in history["turns"]] == [
        ("resp_one", None, "Tell me about zebras", "Zebras have stripes."),
        ("resp_two", "resp_one", "And giraffes?", "Giraffes are tall."),
        ("resp_three", "resp_two", "And okapis?", "Okapis are shy"),
    ]
    assert history["turns"][2]["status_text"] == "Cut off at the token limit"
    assert history["turns"][0]["usage"] == {"input": 30, "cached": 12, "output": 7, "total": 37}
    assert history["earlier"] == []
    mallory = django_user_model.objects.create_user(username="mallory", password="pw-mallory-123")
    assert transcripts.chat_history(owner_id=mallory.pk, public_id="resp_three") is None
    assert transcripts.chat_history(owner_id=user.pk, public_id="resp_missing") is None
    assert transcripts.chat_history(owner_id=user.pk, public_id="x" * 500) is None


def test_chat_history_keeps_turns_whose_rows_expired_as_earlier_messages(user, chain):
    """ADM-4: when the first row is gone, its turn still shows, from the next row's copy."""
    StoredResponse.objects.filter(public_id="resp_one").delete()
    history = transcripts.chat_history(owner_id=user.pk, public_id="resp_three")
    assert [t["id"] for t in history["turns"]] == ["resp_two", "resp_three"]
    assert [(m["role"], m["text"]) for m in history["earlier"]] == [
        ("user", "Tell me about zebras"),
        ("assistant", "Zebras have stripes."),
    ]


def test_recent_conversations_are_one_entry_per_conversation_with_its_branches(
    user, chain, django_user_model
):
    """ADM-4: the list shows each conversation once (not once per branch a regenerate or a stop
    left), linking its newest tip, labelled by its opening words, with its turns and branches."""
    bob = django_user_model.objects.create_user(username="bob", password="pw-bob-123")
    stored(bob, "resp_bob", said="bob's")
    branch = stored(user, "resp_branch", previous="resp_one", said="Other question")
    StoredResponse.objects.filter(pk=branch.pk).update(created_at=timezone.now() + timedelta(seconds=5))
    lone = stored(user, "resp_lone", said="")  # no text to label it by
    StoredResponse.objects.filter(pk=lone.pk).update(created_at=timezone.now() - timedelta(days=1))
    recent = transcripts.conversations_recent(owner_id=user.pk)
    assert [(r["id"], r["root"], r["label"], r["turns"], r["branches"]) for r in recent] == [
        ("resp_branch", "resp_one", "Tell me about zebras", 2, 2),
        ("resp_lone", "resp_lone", recent[1]["label"], 1, 1),
    ]
    assert recent[1]["label"].startswith("Chat with tiny, ") and "resp_" not in recent[1]["label"]
