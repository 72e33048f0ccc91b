"""The audit trail (ADM-6): who loaded, unloaded, reloaded or changed a model, alias or API key, and when.

Entries are the admin's own `LogEntry` rows, so each object's stock history page lists them beside
the admin's change-form saves. Services write them for the `actor` they are given. The admin's
change forms log their saves themselves (`ModelAdmin.log_change`) and so pass no actor: nothing is
recorded twice. Without a signed-in actor (a management command, a script) a change goes to the
server log only, as a `LogEntry` needs a user.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.utils.text import capfirst

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser
    from django.contrib.auth.models import AnonymousUser
    from django.db.models import Model

    Actor = AbstractBaseUser | AnonymousUser | None

logger = logging.getLogger(__name__)
# Bookkeeping, not settings: a change of these alone is no change anybody made.
UNAUDITED_FIELDS = frozenset({"created_at", "updated_at", "last_used_at", "secret_hash"})
ADDED: list[dict[str, Any]] = [{"added": {}}]


def audit_record(
    *, actor: Actor, obj: Model, message: str | list[dict[str, Any]], flag: int = CHANGE
) -> None:
    """Record `message` about `obj` in its admin history, done by `actor` now.

    `message` is a sentence, or Django's JSON change message (`audit_changes`); `flag` is
    LogEntry's ADDITION, CHANGE or DELETION.
    """
    if actor is None or not actor.is_authenticated:
        text = message if isinstance(message, str) else json.dumps(message)
        logger.info("%s %s changed without a signed-in user: %s", obj._meta.label, obj.pk, text)
        return
    # Content types can be created anew (a flush, a restore) under other ids than this process
    # cached; entries are rare, so read them fresh rather than risk a stale id turning an admin
    # action into a 500.
    ContentType.objects.clear_cache()
    LogEntry.objects.log_actions(
        user_id=actor.pk, queryset=[obj], action_flag=flag, change_message=message, single_object=True
    )


def audit_changes(obj: Model) -> list[dict[str, Any]]:
    """Django's change message for saving `obj` now (call it before the save): `ADDED` for a new
    row, else the fields that differ from its row in the database, by their labels; [] for none."""
    if obj.pk is None:
        return ADDED
    fields = [f for f in obj._meta.concrete_fields if not f.primary_key and f.name not in UNAUDITED_FIELDS]
    before = type(obj)._default_manager.filter(pk=obj.pk).values(*(f.attname for f in fields)).first()
    if before is None:
        return ADDED
    changed = [str(capfirst(f.verbose_name)) for f in fields if before[f.attname] != getattr(obj, f.attname)]
    return [{"changed": {"fields": changed}}] if changed else []


def audit_saved(*, actor: Actor, obj: Model, changes: list[dict[str, Any]]) -> None:
    """Record a save whose `changes` `audit_changes` computed before it; nothing when none."""
    if changes:
        audit_record(actor=actor, obj=obj, message=changes, flag=ADDITION if changes == ADDED else CHANGE)


def actor_named(username: str) -> AbstractBaseUser | None:
    """The user called `username` (control messages carry the name of who asked), or None."""
    if not username:
        return None
    user_model = get_user_model()
    return user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username}).first()
