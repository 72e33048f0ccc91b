"""The engine process's side of cross-process control (ADM-3): reconcile, admin actions, the listener.

`run_control_listener` joins the engine group on the channel layer: a `models.changed` message
reconciles the engine with the database, a `models.action` message loads, unloads or reloads a
model through its instance's writer path (LANE-4). The message vocabulary lives in
`models_app.catalogue.control`; the live status is `models_app.catalogue.live_status`. Installed
by `mlxhost.composition`: when the engine starts, the listener runs and the engine is reconciled
(pinned models load).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import ValidationError

from mlxhost.engine import (
    Engine,
    EngineError,
    ModelSpec,
    instance_id_of_name,
    is_internal_name,
)
from mlxhost.runtime import lifecycle
from mlxhost.runtime.lifecycle import Shared
from models_app.catalogue import control, hotcache, selectors, services, specs
from models_app.models import Model, ModelAlias
from models_app.turns import live_responses

logger = logging.getLogger(__name__)

# Channels' Redis layer forgets a group member after a day; re-join well before that.
REJOIN_INTERVAL_S = 600.0
LISTENER_RETRY_S = 2.0
# A rolling reload (issue 15) looks at the hosts before this one this often, and waits for them at
# most as long as a load and a drain may take.
ROLLING_POLL_S = 0.5


# Reconciling ------------------------------------------------------------------------------------


def _served_instance_ids() -> set[int]:
    """The instance ids of every model the database still has (a deleted model's is not here)."""
    return {model.instance_id for model in selectors.models_served() if model.instance_id is not None}


def _desired() -> dict[str, tuple[ModelSpec, bool]]:
    """Every enabled alias -> (the spec of its model, whether that model is pinned)."""
    return {
        alias.name: (specs.model_spec_for(alias=alias), alias.model.pinned)
        for alias in selectors.aliases_enabled()
    }


async def reconcile(engine: Engine, *, load_pinned: bool = True) -> None:
    """Make the engine match the database: drop removed or disabled aliases, apply changed
    settings or weights to bound ones (REG-5, hot swap), and load pinned models.

    Only control binds (this, `models_app.turns.binding.bind_on_demand` and the admin actions);
    requests resolve."""
    desired = await sync_to_async(_desired)()
    served = await sync_to_async(_served_instance_ids)()
    bound = set(engine.bound_names())
    for name in bound:
        if is_alias(name) and name not in desired:
            logger.info("alias %s is gone or disabled: unbinding it", name)
            engine.unbind(name)
        elif (instance_id := instance_id_of_name(name)) is not None and instance_id not in served:
            # Loaded with no alias, then its model was deleted: nothing may keep the weights.
            logger.info("instance %s has no model any more: unbinding it", instance_id)
            engine.unbind(name)
    loads = []
    for name, (spec, pinned) in desired.items():
        pinned = pinned and load_pinned
        if name in bound or pinned:
            instance = engine.bind(name, spec)
            if pinned and instance.state != "ready":
                loads.append(_load_logged(engine, name, spec))
    await asyncio.gather(*loads)


def is_alias(name: str) -> bool:
    """Whether a bound name is an alias, not one of the engine's internal names."""
    return not is_internal_name(name)


async def _load_logged(engine: Engine, name: str, spec: ModelSpec) -> None:
    try:
        logger.info("loading alias %s (instance %s)", name, spec.instance_id)
        await engine.load(spec, name=name)
        logger.info("alias %s ready", name)
    except EngineError as exc:
        logger.error("alias %s failed to load: %s", name, exc)


# Actions ------------------------------------------------------------------------------------------


class Actions:
    """Runs admin actions on models for one engine and remembers the last result per model."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.results: dict[str, dict[str, Any]] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        # Set when an action starts or ends: the status publisher reports at once (ADM-7).
        self.changed = asyncio.Event()

    def start(
        self, model_name: str, action: str, by: str = "", *, rolling: dict[str, Any] | None = None
    ) -> asyncio.Task[None]:
        """Run `action` in the background; one action at a time per model, in arrival order.
        `by` names who asked (for the model's history, ADM-6); empty for the engine's own.

        `rolling` ({"id", "order"}: a fleet-wide reload, `control.request_action`) makes this host
        wait its turn: until every host before it in "order" has finished that reload or left.
        """
        previous = self._running.get(model_name)
        task = asyncio.get_running_loop().create_task(self._after(previous, model_name, action, by, rolling))
        self._running[model_name] = task
        task.add_done_callback(
            lambda t: self._running.pop(model_name, None) if self._running.get(model_name) is t else None
        )
        return task

    async def _after(
        self,
        previous: asyncio.Task[None] | None,
        model_name: str,
        action: str,
        by: str,
        rolling: dict[str, Any] | None,
    ) -> None:
        if previous is not None:
            await asyncio.wait({previous})
        rolling_id = None
        if rolling is not None:
            rolling_id = str(rolling.get("id", ""))
            self.results[model_name] = {"action": action, "state": "waiting", "error": "", "at": time.time()}
            self.changed.set()
            await self._wait_turn(model_name, rolling_id, [int(h) for h in rolling.get("order", [])])
        await self.run(model_name, action, by, rolling_id=rolling_id)

    async def _wait_turn(self, model_name: str, rolling_id: str, order: list[int]) -> None:
        """Wait until the hosts before this one in `order` have finished reload `rolling_id` of
        `model_name` (done or failed), or stopped publishing their status (gone)."""
        me = settings.MLXHOST_HOST_ID
        before = set(order[: order.index(me)]) if me in order else set()
        deadline = time.monotonic() + self.engine.config.load_timeout_s + self.engine.config.drain_timeout_s
        while before and time.monotonic() < deadline:
            statuses = await sync_to_async(control.engine_statuses)()
            finished = {
                s.get("host_id")
                for s in statuses
                if (s.get("actions", {}).get(model_name) or {}).get("rolling_id") == rolling_id
                and s["actions"][model_name]["state"] in ("done", "failed")
            }
            alive = {s.get("host_id") for s in statuses}
            before = {host for host in before if host in alive and host not in finished}
            if before:
                await asyncio.sleep(ROLLING_POLL_S)  # their status comes once a second: poll it
        if before:
            logger.warning(
                "rolling reload of %s: hosts %s did not finish in time; going on", model_name, before
            )

    async def run(self, model_name: str, action: str, by: str = "", *, rolling_id: str | None = None) -> None:
        started_at = time.time()
        self.results[model_name] = {
            "action": action,
            "state": "running",
            "error": "",
            "at": started_at,
            "started_at": started_at,
            "rolling_id": rolling_id,
        }
        self.changed.set()
        try:
            instance_id = await self._run(model_name, action, by)
        except (EngineError, ValidationError, Model.DoesNotExist) as exc:
            error = _reason(exc)
            logger.error("%s of model %s failed: %s", action, model_name, error)
            self.results[model_name] = {
                "action": action,
                "state": "failed",
                "error": error,
                "at": time.time(),
                "started_at": started_at,
                "rolling_id": rolling_id,
            }
            self.changed.set()
            return
        self.results[model_name] = {
            "action": action,
            "state": "done",
            "error": "",
            "at": time.time(),
            "instance_id": instance_id,
            "started_at": started_at,
            "rolling_id": rolling_id,
        }
        self.changed.set()

    async def _run(self, model_name: str, action: str, by: str) -> int | None:
        model = await sync_to_async(_model_named)(model_name)
        if action == "unload":
            return await self._unload(model)
        if action == "load":
            return await self._load(model, specs.model_spec_for(model=model))
        if action == "reload":
            return await self._reload(model, by)
        raise ValueError(f"unknown action {action!r}")

    def _serving(self, model: Model) -> list[str]:
        """The model's enabled aliases: the names its weights are served under."""
        return [alias.name for alias in model.aliases.all() if alias.enabled]

    async def _load(self, model: Model, spec: ModelSpec) -> int:
        """Bind every enabled alias of the model to `spec` and load it (a model without one
        loads by instance id, resident for the aliases to come)."""
        return (await self.engine.serve(self._serving(model), spec)).instance_id

    async def _unload(self, model: Model) -> int | None:
        engine = self.engine
        ids = {engine.resolve(name) for name in self._serving(model) if engine.bound(name)}
        if model.instance_id is not None and engine.hosts(model.instance_id):
            ids.add(model.instance_id)
        for instance_id in sorted(ids):
            await self._drain(instance_id)
        return model.instance_id if ids else None  # None: nothing of it was resident here

    async def _reload(self, model: Model, by: str) -> int:
        """Read the model's weights again. New weights load beside the old instance, which keeps
        serving until they are resident and is kept if they fail (OPS-4)."""
        fresh = await sync_to_async(services.model_fresh_instance)(model=model)
        spec = specs.model_spec_for(model=model, instance=fresh)

        async def switch() -> None:
            if fresh.pk != model.instance_id:
                await sync_to_async(services.model_switch_instance)(
                    model=model, instance=fresh, requested_by=by
                )

        return await self.engine.reload(self._serving(model), spec, on_resident=switch)

    async def _drain(self, instance_id: int) -> None:
        """Drain and free an instance (LANE-7): arrivals get 503/529 `draining` at once, queued
        waiters are refused, running streams get `drain_timeout_s` to finish and are then
        aborted (their streams end saying so); the next request loads it again."""
        await self.engine.drain(instance_id, "wait", self.engine.config.drain_timeout_s)

    def weights_changed(self, names: list[str]) -> None:
        """A load found these aliases' folder changed since registration (REG-3): reload their
        models, which registers the new weights under a new instance id (on the loop)."""
        aliases = [name for name in names if is_alias(name)]
        if not aliases:
            return
        asyncio.get_running_loop().create_task(self._reload_models_of(aliases))

    async def _reload_models_of(self, aliases: list[str]) -> None:
        for model_name in await sync_to_async(_model_names_of)(aliases):
            logger.warning("model %s: weights changed on disk; registering them anew", model_name)
            self.start(model_name, "reload")


def _model_named(name: str) -> Model:
    return (
        Model.objects.select_related("instance", "draft_model__instance")
        .prefetch_related("aliases")
        .get(name=name)
    )


def _model_names_of(aliases: list[str]) -> list[str]:
    return sorted(set(ModelAlias.objects.filter(name__in=aliases).values_list("model__name", flat=True)))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(exc.messages)
    if isinstance(exc, Model.DoesNotExist):
        return "The model does not exist."
    return str(exc) or type(exc).__name__


# The listener -------------------------------------------------------------------------------------


async def run_control_listener(engine: Engine, actions: Actions) -> None:
    """Receive control messages for this engine until cancelled."""
    layer = get_channel_layer()
    if layer is None:
        return
    # The default prefix, not one of ours: channels_redis reads every process-local channel of a
    # layer through one shared Redis list, which a channel with another prefix would take over.
    channel = await layer.new_channel()
    try:
        while True:
            try:
                await layer.group_add(control.ENGINE_GROUP, channel)
                message = await asyncio.wait_for(layer.receive(channel), REJOIN_INTERVAL_S)
            except TimeoutError:
                continue
            except Exception:  # Redis away for a moment: keep listening, the next edit reconciles all
                logger.warning("the control listener lost the channel layer; retrying", exc_info=True)
                await asyncio.sleep(LISTENER_RETRY_S)
                continue
            await handle_message(engine, actions, message)
    finally:
        with contextlib.suppress(Exception):  # shutting down with the layer gone
            await layer.group_discard(control.ENGINE_GROUP, channel)


async def handle_message(engine: Engine, actions: Actions, message: dict[str, Any]) -> None:
    kind = message.get("type")
    try:
        if kind == control.MODELS_CHANGED:
            hotcache.aliases.clear()  # an edit in another process: resolve names afresh
            await reconcile(engine)
        elif kind == control.MODEL_ACTION:
            host = message.get("host")
            if host is not None and host != settings.MLXHOST_HOST_ID:
                return  # meant for another host of the fleet
            actions.start(
                str(message.get("model", "")),
                str(message.get("action", "")),
                str(message.get("by", "")),
                rolling=message.get("rolling"),
            )
        elif kind == control.RESPONSE_CANCEL:
            live_responses.cancel_here(
                public_id=str(message.get("id", "")), owner_id=int(message.get("owner_id", 0))
            )
        else:
            logger.warning("ignoring control message of type %r", kind)
    except Exception:
        logger.exception("control message %r failed", kind)


# The lifecycle ------------------------------------------------------------------------------------

# The one `Actions` of the process's engine (the listener runs them, the status publisher reports them).
ACTIONS: Shared[Actions] = Shared("admin actions")


def actions_for(engine: Engine) -> Actions:
    """The one `Actions` of `engine`, made on first use."""
    actions = lifecycle.PROCESS.peek(ACTIONS)
    if actions is None or actions.engine is not engine:  # a test's fresh engine replaces the last
        actions = Actions(engine)
        lifecycle.PROCESS.put(ACTIONS, actions)
    return actions


def start_control(engine: Engine) -> None:
    """Listen for control messages and reconcile the engine with the database (ADM-3).

    Pinned aliases load now (unless MLXHOST_PRELOAD=false); a failed load is logged and shown in
    /readyz, not fatal.
    """
    actions = actions_for(engine)
    # A load that found an alias's folder changed registers the new weights (REG-3): the reload
    # action computes the fingerprint again, gets a new instance id and swaps to it.
    engine.on_weights_changed(actions.weights_changed)
    lifecycle.spawn(run_control_listener(engine, actions), name="engine-control")
    runtime = lifecycle.runtime_settings()
    lifecycle.spawn(reconcile(engine, load_pinned=runtime.preload), name="engine-reconcile")
    if runtime.reconcile_interval_s > 0:
        lifecycle.spawn(run_periodic_reconcile(engine, runtime.reconcile_interval_s), name="engine-resync")


async def run_periodic_reconcile(engine: Engine, interval_s: float) -> None:
    """Reconcile every `interval_s` until cancelled: the fallback for edits no message announced.
    Pinned models are not loaded here (an admin's unload of one stands until the next start)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await reconcile(engine, load_pinned=False)
        except Exception:  # the database away for a moment: the next round tries again
            logger.warning("periodic reconcile failed", exc_info=True)
