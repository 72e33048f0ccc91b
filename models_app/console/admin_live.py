"""The admin's live state of models and aliases: what the engines report, rendered for the
changelists' columns and the change pages, from one status read per request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.utils.html import format_html

from models_app.console.live_state import AliasLiveState, alias_live_state, live_views, model_live_state
from models_app.models import Model, ModelAlias

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from django.http import HttpRequest
    from django.utils.safestring import SafeString

DASH = "—"
# LANE-1: a concurrency above 1 on weights that cannot batch is clamped to 1 by the engine.
CANNOT_BATCH_NOTE = (
    "This model cannot batch (its KV cache cannot merge sequences), so it serves one request at a "
    "time whatever its concurrency says; the others wait in its queue."
)


def live_state_html(live: AliasLiveState) -> SafeString:
    """The state badge, with a progress bar while loading and the reason of an error."""
    badge = format_html('<span class="mlxhost-state mlxhost-state-{}">{}</span>', live.state, live.label)
    if live.state == "loading":
        percent = live.progress_percent
        if percent is None:  # nothing to count (starting, checking, building): an indeterminate bar
            return format_html(
                '{} <progress class="mlxhost-progress"></progress> {}',
                badge,
                live.progress_words or "starting",
            )
        return format_html(
            '{} <progress class="mlxhost-progress" value="{}" max="100" title="{} of {}">{}%</progress> {}: {}%',
            badge,
            percent,
            live.progress_done,
            live.progress_total,
            percent,
            live.progress_words or "loading",
            percent,
        )
    if live.state == "error":
        return format_html('{} <span class="mlxhost-error">{}</span>', badge, live.error)
    return badge


def live_load_text(live: AliasLiveState, *, short: bool = False) -> str:
    if not live.resident_counts:
        return DASH
    if short:
        clamped = " (cannot batch)" if live.cannot_batch else ""
        return f"{live.active} / {live.queued} / {live.capacity}{clamped}"
    text = f"{live.active} active / {live.queued} queued (capacity {live.capacity})"
    if live.cannot_batch:
        text += f". {CANNOT_BATCH_NOTE}"
    return text


def last_action_html(live: AliasLiveState) -> SafeString | str:
    if not live.last_action:
        return DASH
    return format_html(
        '<span class="mlxhost-action mlxhost-action-{}">{}</span>', live.last_action_state, live.last_action
    )


def live_state_of(
    obj: Model | ModelAlias,
    views: Mapping[int, Mapping[str, Any]] | None,
    actions: Mapping[str, Mapping[str, Any]],
) -> AliasLiveState:
    """The live state of a model, or of an alias (its model's, unless it is disabled)."""
    if isinstance(obj, Model):
        return model_live_state(model=obj, views=views, actions=actions)
    return alias_live_state(alias=obj, views=views, actions=actions)


def live_context(obj: Model | ModelAlias) -> dict[str, Any]:
    """What a change page shows of `obj`'s live state (live_change_form.html), from a fresh read."""
    live = live_state_of(obj, *live_views())
    return {
        "live": live,
        "live_state_html": live_state_html(live),
        "live_load_text": live_load_text(live),
        "last_action_html": last_action_html(live),
    }


class LiveColumns:
    """The changelist's live columns for one request: one status read per page, one state per row."""

    def __init__(self) -> None:
        self.views, self.actions = live_views()
        self._states: dict[tuple[str, int], AliasLiveState] = {}

    def state_of(self, obj: Model | ModelAlias) -> AliasLiveState:
        key = (type(obj).__name__, obj.pk)
        if key not in self._states:
            self._states[key] = live_state_of(obj, self.views, self.actions)
        return self._states[key]

    def columns(self) -> tuple[Callable[[Any], Any], ...]:
        @admin.display(description="live state")
        def live_state(obj: Model | ModelAlias) -> SafeString:
            return live_state_html(self.state_of(obj))

        @admin.display(description="instance")
        def instance_live(obj: Model | ModelAlias) -> str:
            instance_id = self.state_of(obj).instance_id
            return f"#{instance_id}" if instance_id else DASH

        @admin.display(description="active / queued / capacity")
        def requests_live(obj: Model | ModelAlias) -> str:
            return live_load_text(self.state_of(obj), short=True)

        @admin.display(description="prefix cache")
        def warm_sessions(obj: Model | ModelAlias) -> str:
            live = self.state_of(obj)
            if not live.resident_counts:
                return DASH
            hits = live.cache_hit_percent
            return f"{live.warm_sessions} · {hits}% hits" if hits is not None else str(live.warm_sessions)

        @admin.display(description="last action")
        def last_action(obj: Model | ModelAlias) -> SafeString | str:
            return last_action_html(self.state_of(obj))

        return (live_state, instance_live, requests_live, warm_sessions, last_action)


def live_columns(request: HttpRequest) -> LiveColumns:
    columns: LiveColumns | None = getattr(request, "_mlxhost_live_columns", None)
    if columns is None:  # Django asks more than once per page; read the engines' status once
        columns = LiveColumns()
        request._mlxhost_live_columns = columns  # type: ignore[attr-defined]  # a per-request memo
    return columns
