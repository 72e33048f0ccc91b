"""Reads, and only reads: aliases and models, API keys and sessions, stored rows and their chains.

A row in the engine's terms (specs, sampling, template options) is `catalogue.specs`; the admin's
live state is `console.live_state`; the model folders on disk are `catalogue.folders`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.conf import settings
from django.utils import timezone

from models_app.accounting.apikeys import key_matches, key_prefix
from models_app.models import ApiKey, Model, ModelAlias, StoredResponse

if TYPE_CHECKING:
    from django.db.models import QuerySet


def alias_resolve(*, name: str) -> ModelAlias:
    """The enabled alias called `name`, with its model and instance. Never treats `name` as a path.

    Raises:
        ModelAlias.DoesNotExist: no enabled alias has that name, or its model has no instance yet.
    """
    return ModelAlias.objects.select_related(
        "model__instance", "model__draft_model__instance", "adapter"
    ).get(name=name, enabled=True, model__instance__isnull=False)


def aliases_enabled() -> QuerySet[ModelAlias]:
    return ModelAlias.objects.select_related(
        "model__instance", "model__draft_model__instance", "adapter"
    ).filter(enabled=True, model__instance__isnull=False)


def aliases_for_chat() -> QuerySet[ModelAlias]:
    """The enabled aliases of chat models, by name: what the chat page offers (ADM-4)."""
    return aliases_enabled().filter(model__kind__in=Model.GENERATING_KINDS).order_by("name")


def models_with_aliases() -> QuerySet[Model]:
    """Every model, by name, with its instance and its aliases (the Models page, ADM-7)."""
    return (
        Model.objects.select_related("instance", "draft_model__instance")
        .prefetch_related("aliases__adapter")
        .order_by("name")
    )


def models_served() -> QuerySet[Model]:
    """Every model with an instance, with its aliases (the engines' desired state)."""
    return (
        Model.objects.select_related("instance", "draft_model__instance")
        .prefetch_related("aliases")
        .filter(instance__isnull=False)
    )


def apikey_authenticate(*, raw_key: str) -> ApiKey | None:
    """The live key matching `raw_key` (owner active, not revoked), or None."""
    if not raw_key:
        return None
    key = (
        ApiKey.objects.select_related("owner")
        .filter(prefix=key_prefix(raw_key), revoked_at__isnull=True, owner__is_active=True)
        .first()
    )
    if key is None or not key_matches(raw_key, key.secret_hash):
        return None
    return key


def apikey_is_live(*, key_id: int) -> bool:
    """True while the key is not revoked or deleted and its owner is active (socket re-check)."""
    return ApiKey.objects.filter(pk=key_id, revoked_at__isnull=True, owner__is_active=True).exists()


def session_is_live(*, session_key: str, user_id: int) -> bool:
    """True while the session exists, has not expired and is still `user_id`'s login, and that
    user is active and has not changed password since (socket re-check)."""
    from importlib import import_module

    from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model

    data = import_module(settings.SESSION_ENGINE).SessionStore(session_key=session_key).load()
    if data.get(SESSION_KEY) != str(user_id):
        return False
    user = get_user_model().objects.filter(pk=user_id, is_active=True).first()
    return user is not None and data.get(HASH_SESSION_KEY) == user.get_session_auth_hash()


def response_get(*, public_id: str, owner_id: int) -> StoredResponse:
    """The caller's unexpired stored response; another tenant's id is exactly a missing one (PER-6).

    Raises:
        StoredResponse.DoesNotExist: no such row for this owner (or it expired).
    """
    return StoredResponse.objects.select_related("alias").get(
        public_id=public_id, owner_id=owner_id, expires_at__gt=timezone.now()
    )


def responses_landed(*, public_ids: Iterable[str]) -> set[str]:
    """Which of `public_ids` have a row (any owner): the persist monitor's one query per tick."""
    ids = list(public_ids)
    return set(StoredResponse.objects.filter(public_id__in=ids).values_list("public_id", flat=True))


# The admin's reads: stored-response chains (ADM-5) ----------------------------------------------

RESPONSE_CHAIN_MAX_DEPTH = 100


@dataclass(frozen=True, slots=True)
class ResponseChain:
    """A stored response and its ancestors, root first (the admin's chain view)."""

    turns: list[StoredResponse]
    missing_id: str = ""  # an ancestor that is not stored for this owner (expired or deleted)
    truncated: bool = False  # stopped after `max_depth` rows before reaching the root


def response_chain(*, response: StoredResponse, max_depth: int = RESPONSE_CHAIN_MAX_DEPTH) -> ResponseChain:
    """Follow `previous_response_id` from `response` back to the root, within its owner only
    (PER-6), reading at most `max_depth` rows. Expired rows still count: this is for staff."""
    turns, seen = [response], {response.public_id}
    missing, truncated = "", False
    current = response
    while current.previous_response_id:
        parent_id = current.previous_response_id
        if len(turns) >= max_depth or parent_id in seen:  # ids are random: a cycle is corrupt data
            truncated = True
            break
        parent = StoredResponse.objects.filter(public_id=parent_id, owner_id=response.owner_id).first()
        if parent is None:
            missing = parent_id
            break
        turns.append(parent)
        seen.add(parent_id)
        current = parent
    turns.reverse()
    return ResponseChain(turns=turns, missing_id=missing, truncated=truncated)


def response_input_text(*, response: StoredResponse) -> str:
    """The user input of one stored turn as plain text (its request's `input` turns)."""
    raw = (response.request or {}).get("input")
    if isinstance(raw, str):
        return raw
    parts: list[str] = []
    for turn in raw or []:
        if not isinstance(turn, Mapping) or turn.get("role", "user") not in ("user", "system", "developer"):
            continue
        content = turn.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return "\n".join(part for part in parts if part)
