"""Reads: aliases, API keys, sampling, specs, stored rows, and the admin's live state, folders and chains."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.utils import timezone

from mlxhost.engine import (
    ALIAS_SAMPLING_FIELDS,
    SAMPLING_KNOBS,
    InvalidModelFolderError,
    LaneSettings,
    ModelSpec,
    SamplingParams,
    resolve_under,
)
from models_app.accounting.apikeys import key_matches, key_prefix
from models_app.catalogue import control
from models_app.models import ApiKey, Model, ModelAlias, ModelInstance, StoredResponse

if TYPE_CHECKING:
    from django.db.models import QuerySet

# Shaped apart in `sampling_params_for`: clamped by the alias, or turned into tuples.
_SHAPED_FIELDS = ("max_tokens", "stop", "logit_bias")
# The alias defaults the request's values override, and the knobs only a request sets.
SAMPLING_FIELDS = tuple(name for name in ALIAS_SAMPLING_FIELDS if name not in _SHAPED_FIELDS)
REQUEST_ONLY_FIELDS = tuple(
    name for name in SAMPLING_KNOBS if name not in ALIAS_SAMPLING_FIELDS and name not in _SHAPED_FIELDS
)


def alias_resolve(*, name: str) -> ModelAlias:
    """The enabled alias called `name`, with its model and instance. Never treats `name` as a path.

    Raises:
        ModelAlias.DoesNotExist: no enabled alias has that name, or its model has no instance yet.
    """
    return ModelAlias.objects.select_related("model__instance").get(
        name=name, enabled=True, model__instance__isnull=False
    )


def aliases_enabled() -> QuerySet[ModelAlias]:
    return ModelAlias.objects.select_related("model__instance").filter(
        enabled=True, model__instance__isnull=False
    )


def aliases_for_chat() -> QuerySet[ModelAlias]:
    """The enabled aliases of chat models, by name: what the chat page offers (ADM-4)."""
    return aliases_enabled().filter(model__kind=Model.Kind.CHAT).order_by("name")


def models_with_aliases() -> QuerySet[Model]:
    """Every model, by name, with its instance and its aliases (the Models page, ADM-7)."""
    return Model.objects.select_related("instance").prefetch_related("aliases").order_by("name")


def models_served() -> QuerySet[Model]:
    """Every model with an instance, with its aliases (the engines' desired state)."""
    return Model.objects.select_related("instance").prefetch_related("aliases").filter(instance__isnull=False)


def model_spec_for(
    *, model: Model | None = None, alias: ModelAlias | None = None, instance: ModelInstance | None = None
) -> ModelSpec:
    """What the engine needs to host `model` (or `alias`'s model) on its instance, or on `instance`,
    weights being reloaded for it. Lane and memory settings come from the model only, so every
    alias of it gives the same spec; the engine never sees an alias's settings."""
    if model is None:
        assert alias is not None, "pass a model or an alias"
        model = alias.model
    instance = instance or model.instance
    assert instance is not None, "a model is saved with its instance"
    if instance.source_kind == ModelInstance.SourceKind.HUB:
        source, revision = instance.source, instance.revision or None
    else:
        source, revision = str(resolve_under(Path(settings.MODELS_ROOT), instance.source)), None
    return ModelSpec(
        instance_id=instance.pk,
        source=source,
        revision=revision,
        fingerprint=instance.fingerprint,
        # A local folder is re-hashed at every load, so edited files never keep the old id (REG-3).
        verify_weights=instance.source_kind == ModelInstance.SourceKind.LOCAL,
        lane=LaneSettings(
            capacity=model.concurrency,
            queue_depth=model.queue_depth,
            unbounded=model.queue_unbounded,
            queue_timeout_s=model.queue_timeout_s,
        ),
        keep_alive_s=model.keep_alive_s,  # None: never freed for idleness (OPS-3)
        pinned=model.pinned,
        kind="embedding" if model.kind == Model.Kind.EMBEDDING else "chat",
    )


def sampling_params_for(*, alias: ModelAlias, overrides: Mapping[str, Any]) -> SamplingParams:
    """Merge request > alias default > engine default, and clamp output length by the alias."""
    values: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = overrides.get(name)
        values[name] = value if value is not None else getattr(alias, name)
    for name in REQUEST_ONLY_FIELDS:
        if overrides.get(name) is not None:
            values[name] = overrides[name]
    wanted = overrides.get("max_tokens") or alias.max_tokens
    values["max_tokens"] = max(1, min(int(wanted), alias.max_output_tokens))
    values["stop"] = tuple(overrides.get("stop") or ())
    values["logit_bias"] = tuple(
        sorted((int(k), float(v)) for k, v in (overrides.get("logit_bias") or {}).items())
    )
    return SamplingParams(**values)


# Reasoning effort as Anthropic (`output_config.effort`) and OpenAI (`reasoning.effort`,
# `reasoning_effort`) name it, and what reaches the chat template's `reasoning_effort` (the
# low/medium/high that templates with that keyword know). None: thinking off.
EFFORTS: dict[str, str | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


def template_options_for(
    alias: ModelAlias, *, thinking: bool | None = None, effort: str | None = None
) -> tuple[tuple[str, object], ...]:
    """The alias's chat-template keywords (API-9); a request's own `thinking` choice wins over the
    alias's, and neither set leaves the model's default.

    A request's reasoning `effort` (a key of EFFORTS) goes to the template as `reasoning_effort`
    and, where the request left `thinking` open, sets the thinking switch: on for any effort but
    "none" and "minimal". A template without these keywords ignores them.
    """
    options = dict(alias.chat_template_kwargs or {})
    if effort is not None:
        level = EFFORTS[effort]
        if level is not None:
            options["reasoning_effort"] = level
        if thinking is None:
            thinking = effort not in ("none", "minimal")
    choice = thinking if thinking is not None else alias.enable_thinking
    if choice is not None:
        options["enable_thinking"] = choice
    return tuple(sorted(options.items()))


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


# The admin's reads: live state per alias, model folders, and stored-response chains (ADM-1, OPS-4) --

MODEL_FOLDER_DEPTH = 2  # MODELS_ROOT/<name> or MODELS_ROOT/<owner>/<name>
RESPONSE_CHAIN_MAX_DEPTH = 100


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
    # The engine's status publisher names the state and its words (mlxhost.runtime.status).
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
        for model in models_with_aliases()
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


def model_folders_available(*, root: Path | None = None) -> list[str]:
    """Folders under MODELS_ROOT that look like mlx-lm models (config.json and *.safetensors),
    relative to it, at most MODEL_FOLDER_DEPTH levels down; what the admin offers for `local_path`.

    Only a shape check: registering one still runs the full validation (remote code, weights).
    """
    root = (root or Path(settings.MODELS_ROOT)).resolve()
    if not root.is_dir():
        return []
    found: list[str] = []
    pending = [(root, 0)]
    while pending:
        folder, depth = pending.pop()
        for child in _subfolders(folder):
            try:
                resolve_under(root, str(child.relative_to(root)))  # a symlink must not leave the root
            except InvalidModelFolderError:
                continue
            if (child / "config.json").is_file() and any(child.glob("*.safetensors")):
                found.append(child.relative_to(root).as_posix())
            elif depth + 1 < MODEL_FOLDER_DEPTH:
                pending.append((child, depth + 1))
    return sorted(found)


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []


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
