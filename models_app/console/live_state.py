"""The admin's live state of each model and alias, from what the engines publish (ADM-1, ADM-7, OPS-4):
the admin, the Models page and the admin index's "models up" render it as it comes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from models_app.catalogue import control, selectors

if TYPE_CHECKING:
    from collections.abc import Mapping

    from models_app.models import Model, ModelAlias


@dataclass(frozen=True, slots=True)
class AliasLiveState:
    """What the engines report about one model (or an alias of it), ready to show.

    `state` is one of: unreported (no engine process publishes status), disabled (the alias is
    not served), unloaded, loading, resident, degraded, draining, error.
    """

    state: str
    label: str
    instance_id: int | None = None
    error: str = ""
    active: int = 0
    queued: int = 0
    capacity: int = 0
    # Its weights cannot batch (LANE-1): the lane serves one at a time, whatever the concurrency.
    cannot_batch: bool = False
    warm_sessions: int = 0
    warm_bytes: int = 0
    cache_hit_rate: float | None = None  # of the prefix cache's lookups; None before the first
    cache_tokens_saved: int = 0
    disk_entries: int | None = None  # the disk tier (SES-9); None when it is off
    disk_bytes: int = 0
    disk_hit_rate: float | None = None
    progress_done: int = 0
    progress_total: int = 0
    progress_phase: str = ""
    # A hub download's file in flight (issue 28): its path, and its bytes of its size.
    progress_file: str = ""
    progress_file_done: int = 0
    progress_file_total: int = 0
    last_action: str = ""  # "reload failed: <reason>", "load done", "unload running"
    last_action_state: str = ""  # waiting (its turn in a rolling reload) | running | done | failed
    memory_bytes: int = 0
    tokens_per_s: float = 0.0
    unload_label: str = ""  # when the keep-alive frees it, in the publisher's words (OPS-3)
    # In a fleet, each host's view of the instance (host, label, active, queued, capacity, memory).
    hosts: tuple[Mapping[str, Any], ...] = ()

    @property
    def reporting(self) -> bool:
        return self.state != "unreported"

    @property
    def resident_counts(self) -> bool:
        """Whether the request and session counters mean anything (an engine holds the instance)."""
        return self.state not in ("unreported", "unloaded", "disabled")

    @property
    def cache_hit_percent(self) -> int | None:
        return None if self.cache_hit_rate is None else round(100 * self.cache_hit_rate)

    @property
    def disk_hit_percent(self) -> int | None:
        return None if self.disk_hit_rate is None else round(100 * self.disk_hit_rate)

    @property
    def allowed_actions(self) -> tuple[str, ...]:
        """The admin actions that make sense now (ADM-7); none while one is still running."""
        if self.last_action_state == "running":
            return ()
        return control.ACTIONS_BY_STATE.get(self.state, ())

    @property
    def progress_words(self) -> str:
        """The load's phase in words (OPS-4); the percent belongs to the phases that count."""
        return LOAD_PHASE_WORDS.get(self.progress_phase, "")

    @property
    def progress_percent(self) -> int | None:
        if self.progress_total <= 0 or self.progress_phase in UNCOUNTED_PHASES:
            return None
        return max(0, min(100, round(100 * self.progress_done / self.progress_total)))


# A load's phases (mlxhost.engine.instance.LoadProgress), as the admin and the pages' scripts say them.
LOAD_PHASE_WORDS = {
    "starting": "starting",
    "verify": "checking the weights",
    "download": "downloading",
    "read": "reading the weights",
    "build": "building the model in memory",
}
UNCOUNTED_PHASES = frozenset({"starting", "verify", "build"})


def live_views() -> tuple[dict[int, dict[str, Any]] | None, dict[str, dict[str, Any]]]:
    """(instance views, last action per alias) from every engine publishing status; the views are
    None when no engine process reports at all (so the admin says so instead of guessing)."""
    statuses = control.engine_statuses()
    if not statuses:
        return None, {}
    return control.instance_views(statuses), control.action_views(statuses)


def model_live_state(
    *,
    model: Model,
    views: Mapping[int, Mapping[str, Any]] | None,
    actions: Mapping[str, Mapping[str, Any]],
) -> AliasLiveState:
    """The live state of `model` from `live_views()` output (views None: no engine reporting)."""
    result = actions.get(model.name)
    names = {alias.name for alias in model.aliases.all()}

    def idle(state: str, label: str) -> AliasLiveState:
        action, action_state = _action_text(result, state)
        return AliasLiveState(
            state=state,
            label=label,
            instance_id=model.instance_id,
            last_action=action,
            last_action_state=action_state,
        )

    if views is None:
        return idle("unreported", control.NO_ENGINE_LABEL)
    view = _view_for(model.instance_id, names, views)
    if view is None:
        return idle("unloaded", control.LIVE_LABELS["unloaded"])
    # The engine's status publisher names the state and its words (models_app.catalogue.live_status).
    state = str(view.get("live_state") or "unloaded")
    action, action_state = _action_text(result, state)
    progress = view.get("load_progress") or {}
    return AliasLiveState(
        state=state,
        label=str(view.get("label") or control.LIVE_LABELS["unloaded"]),
        instance_id=view.get("instance_id"),
        error=str(view.get("error") or "") if state == "error" else "",
        active=int(view.get("active") or 0),
        queued=int(view.get("queued") or 0),
        capacity=int(view.get("capacity") or 0),
        cannot_batch=view.get("can_batch") is False,
        warm_sessions=int(view.get("warm_sessions") or 0),
        warm_bytes=int(view.get("warm_bytes") or 0),
        cache_hit_rate=view.get("cache_hit_rate"),
        cache_tokens_saved=int(view.get("cache_tokens_saved") or 0),
        disk_entries=view.get("disk_entries"),
        disk_bytes=int(view.get("disk_bytes") or 0),
        disk_hit_rate=view.get("disk_hit_rate"),
        progress_done=int(progress.get("done") or 0),
        progress_total=int(progress.get("total") or 0),
        progress_phase=str(progress.get("phase") or ""),
        progress_file=str(progress.get("file") or ""),
        progress_file_done=int(progress.get("file_done") or 0),
        progress_file_total=int(progress.get("file_total") or 0),
        last_action=action,
        last_action_state=action_state,
        memory_bytes=int(view.get("memory_bytes") or 0),
        tokens_per_s=float(view.get("tokens_per_s") or 0.0),
        unload_label=str(view.get("unload_label") or ""),
        hosts=tuple(view.get("hosts") or ()),
    )


def alias_live_state(
    *,
    alias: ModelAlias,
    views: Mapping[int, Mapping[str, Any]] | None,
    actions: Mapping[str, Mapping[str, Any]],
) -> AliasLiveState:
    """The live state of `alias`: its model's, unless the alias itself is disabled."""
    live = model_live_state(model=alias.model, views=views, actions=actions)
    still_bound = views is not None and any(alias.name in view.get("aliases", ()) for view in views.values())
    if not alias.enabled and views is not None and not still_bound:
        # Its weights may be resident for another alias, but nothing is served under this name.
        return replace(live, state="disabled", label="disabled (not served)", active=0, queued=0)
    return live


@dataclass(frozen=True, slots=True)
class ModelsUp:
    """How many models are up, for the admin index's summary (ADM-7)."""

    total: int
    up: list[str]  # resident (degraded too), by name
    loading: int
    failed: int
    reporting: bool  # False: no engine process publishes status


def models_up() -> ModelsUp:
    """Which models the engines hold now, from one read of their status."""
    views, actions = live_views()
    states = [
        (model.name, model_live_state(model=model, views=views, actions=actions).state)
        for model in selectors.models_with_aliases()
    ]
    return ModelsUp(
        total=len(states),
        up=[name for name, state in states if state in control.RESIDENT_STATES],
        loading=sum(state == "loading" for _, state in states),
        failed=sum(state == "error" for _, state in states),
        reporting=views is not None,
    )


def _view_for(
    instance_id: int | None, names: set[str], views: Mapping[int, Mapping[str, Any]]
) -> Mapping[str, Any] | None:
    # What an engine serves under the names is the truth (a hot swap may be ahead of this row);
    # otherwise the row's instance.
    bound = [view for view in views.values() if names & set(view.get("aliases", ()))]
    for view in bound:
        if view.get("instance_id") == instance_id:
            return view
    if bound:
        return bound[0]
    return views.get(instance_id) if instance_id is not None else None


# The latest event, when a finished action is no longer the last thing that happened to a model:
# a request loaded it on demand after an unload, or it left memory (idle, or for memory) after a
# load. Mirrored by static/mlxhost/models.js (actionText).
LOADED_SINCE = "loaded on demand since the unload"
UNLOADED_SINCE = "unloaded since the {action}"
IN_MEMORY_STATES = frozenset({"loading", *control.RESIDENT_STATES})


def _action_text(result: Mapping[str, Any] | None, live_state: str = "") -> tuple[str, str]:
    """The model's latest event in words, and its state: the last admin action, unless the live
    state says something happened since (a finished unload, and the weights are in memory)."""
    if not result:
        return "", ""
    action, state = str(result.get("action", "")), str(result.get("state", ""))
    if state == "failed":
        return f"{action} failed: {result.get('error') or 'no reason given'}", state
    if state == "done" and action == "unload" and live_state in IN_MEMORY_STATES:
        return LOADED_SINCE, state
    if state == "done" and action in ("load", "reload") and live_state == "unloaded":
        return UNLOADED_SINCE.format(action=action), state
    return f"{action} {state}", state
