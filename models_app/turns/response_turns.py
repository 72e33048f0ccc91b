"""The Responses use case: chain loading, the weights check, retention and the persist record.

Shared by `POST /v1/responses` (SSE or JSON) and the `/ws/v1/responses` socket (API-1, API-3).
It runs inside the turn service (`models_app.turns.turns`) as that turn's `TurnHooks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from mlxhost.engine import Done, Failed, Message, ToolCall, Usage
from mlxhost.runtime import BOOT_ID
from models_app.catalogue import control
from models_app.models import StoredResponse
from models_app.persistence.persistence import ResponseRecord, persistence
from models_app.turns import conversations, item_references, live_responses
from models_app.turns.images import stored_image, turn_images
from models_app.turns.response_ids import new_response_id
from models_app.turns.turns import CacheScope, StartedTurn, TurnHooks, TurnRequest, TurnResult, turn_start

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Awaitable, Callable

    from mlxhost.engine import Engine, Permit, Retention, Role
    from models_app.accounting.identity import KeyIdentity
    from models_app.models import ModelAlias
    from models_app.turns.response_request import ResponseRequest

# The id is not echoed: a foreign id and a missing one answer the very same bytes (PER-6).
NOT_FOUND = "No response found with that id."
WEIGHTS_CHANGED = (
    "The model {model!r} now serves different weights than the ones that produced {id!r}; "
    "start a new conversation."
)
NOT_CONTINUABLE = "Response {id!r} failed, so it cannot be continued."
# Engine finish reasons -> (response status, incomplete reason).
STATUS = {
    "stop": ("completed", None),
    "tool_calls": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "cancelled": ("cancelled", None),
    # Cut short by a drain timeout (unload, reload, shutdown): incomplete, and why.
    "aborted": ("incomplete", "draining"),
}


class ChainError(Exception):
    """A stored response that cannot be read or continued, with what a client may be told: the
    API layer maps it to its surface's error envelope."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def not_found() -> ChainError:
    # Byte-identical for a missing id and another tenant's id (PER-6).
    return ChainError(404, NOT_FOUND, code="response_not_found", param="response_id")


async def response_cancel(*, public_id: str, owner_id: int) -> bool:
    """Stop the caller's response `public_id` if it is queued or running on any host (LANE-6).

    Returns whether it was live: here (cancelled at once) or, in a fleet, on another host (the
    cancel goes there over the channel layer). False: it is stored, pending or unknown.
    """
    if live_responses.cancel_here(public_id=public_id, owner_id=owner_id):
        return True
    if await live_responses.shared_owner(public_id) == owner_id:
        await control.cancel_everywhere(public_id=public_id, owner_id=owner_id)
        return True
    return False


def response_status(event: Done | Failed | None) -> str:
    """A turn's stored status from how it ended (None: the listener left, so it was cancelled)."""
    if isinstance(event, Failed):
        return "failed"
    if event is None:
        return "cancelled"
    return STATUS.get(event.finish_reason, ("completed", None))[0]


def output_message(
    response_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The finished assistant message item, as the answer shows it and the row stores it."""
    return {
        "type": "message",
        "id": "msg_" + response_id.removeprefix("resp_"),
        "status": "completed" if status in ("completed", "tool_calls") else "incomplete",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}],
    }


def function_call_item(
    response_id: str,
    index: int,
    call: ToolCall,
    status: str = "completed",
    namespaced: dict[str, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """A call the model made, as a `function_call` output item (its `call_id` is the call's id); a
    namespaced function's call carries its bare name and its `namespace`, as Codex routes them."""
    item: dict[str, Any] = {
        "type": "function_call",
        "id": f"fc_{response_id.removeprefix('resp_')}_{index}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }
    if namespaced and call.name in namespaced:
        item["namespace"], item["name"] = namespaced[call.name]
    return item


def reasoning_item(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The model's reasoning as a `reasoning` output item (never part of the message)."""
    return {
        "type": "reasoning",
        "id": "rs_" + response_id.removeprefix("resp_"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
        "status": status,
    }


def output_items(
    response_id: str,
    text: str,
    status: str,
    done: Done | None,
    logprobs: list[dict[str, Any]] | None = None,
    namespaced: dict[str, tuple[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """A finished response's output: its reasoning, its message (unless it only called tools), and
    its calls, in that order; what the answer shows and the row stores."""
    if status == "failed":
        return []
    calls = done.tool_calls if done is not None else ()
    items = [reasoning_item(response_id, done.reasoning)] if done is not None and done.reasoning else []
    if text or not calls:
        items.append(output_message(response_id, text, status, logprobs))
    items += [function_call_item(response_id, i, call, namespaced=namespaced) for i, call in enumerate(calls)]
    return items


def turn_message(turn: dict[str, Any], names: dict[str, str], *, current: bool = False) -> Message:
    """A stored chain turn as the engine's Message: text with a user's images, or an assistant's
    calls, or a call's result (whose function is named by `names`, call id -> name, from earlier
    turns). `current`: a turn of this request, whose images' errors name their parts."""
    calls = tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in turn.get("tool_calls") or ())
    for call in calls:
        names[call.id] = call.name
    if turn["role"] == "tool":
        call_id = turn.get("tool_call_id") or ""
        return Message("tool", turn["content"], tool_call_id=call_id, name=names.get(call_id))
    # An error about an image names the request's part, or the parent for one of the chain's.
    images = tuple(
        stored_image(image, image.get("param", "") if current else "previous_response_id")
        for image in turn.get("images") or ()
    )
    return Message(role=cast("Role", turn["role"]), content=turn["content"], tool_calls=calls, images=images)


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    """Responses' usage object (stored with the row as the answer shows it)."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


async def _parent(request: ResponseRequest, owner_id: int) -> StoredResponse | None:
    public_id = request.previous_response_id
    if not public_id:
        return None
    try:
        parent = await persistence().fetch(public_id=public_id, owner_id=owner_id)
    except StoredResponse.DoesNotExist:
        raise ChainError(404, NOT_FOUND, code="response_not_found", param="previous_response_id") from None
    if parent.status not in conversations.CONTINUABLE:
        raise ChainError(400, NOT_CONTINUABLE.format(id=public_id), param="previous_response_id")
    return parent


def _check_weights(parent: StoredResponse | None, alias_name: str, retention: Retention) -> None:
    # The weights the engine serves the name from now (REG-4), never the alias row's: a row
    # read before a swap would name the old ones.
    if parent is None:
        return
    same = conversations.response_same_weights(
        parent=parent,
        live_instance_id=retention.instance_id,
        fingerprint=retention.fingerprint,
        boot_id=BOOT_ID,
    )
    if not same:
        message = WEIGHTS_CHANGED.format(model=alias_name, id=parent.public_id)
        raise ChainError(400, message, code="model_changed", param="previous_response_id")


class ResponseHooks(TurnHooks):
    """One Responses turn's steps: load the chain and retain the instance under the permit, and
    store the turn when it ends (PER-1), letting the instance go once the row lands (REG-6/7)."""

    def __init__(self, request: ResponseRequest, owner_id: int, response_id: str) -> None:
        self.request = request
        self.owner_id = owner_id
        # The input turns, with each item reference replaced by the turn it names once `prepare` ran.
        self.turns: list[dict[str, Any]] = [dict(turn) for turn in request.turns]
        self.response_id = response_id
        self.instructions: str | None = None
        self.history: list[dict[str, Any]] = []  # earlier turns, through the parent's answer
        self.alias: ModelAlias | None = None
        self.retention: Retention | None = None
        self.created_at = 0.0  # when the turn started (unix seconds, with the fraction)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return [*self.history, *(t for t in self.turns if t["role"] != "system")]

    def messages(self) -> tuple[Message, ...]:
        system = [t["content"] for t in self.turns if t["role"] == "system"]
        instructions = "\n".join([self.instructions, *system] if self.instructions else system)
        head: tuple[Message, ...] = (Message(role="system", content=instructions),) if instructions else ()
        # Input roles arrive normalised to the engine's (responses_input.INPUT_ROLES); system ones are above.
        names: dict[str, str] = {}
        current = [t for t in self.turns if t["role"] != "system"]
        return (
            head
            + tuple(turn_message(t, names) for t in self.history)
            + tuple(turn_message(t, names, current=True) for t in current)
        )

    async def prepare(
        self, engine: Engine, alias: ModelAlias, permit: Permit, turn: TurnRequest
    ) -> TurnRequest:
        # The permit comes before the chain (LANE-3): loading it may wait up to 2 s for a pending
        # write (PER-2), and a full lane answers 429 before any 404, 400 or 503 about the parent.
        parent = await _parent(self.request, self.owner_id)
        try:
            self.turns = await item_references.turns_resolved(self.turns, owner_id=self.owner_id)
        except item_references.ItemNotFoundError as exc:
            raise ChainError(400, str(exc), code="item_not_found", param=exc.param) from None
        if parent is not None:
            self.instructions, self.history = conversations.conversation_of(parent=parent)
        if self.request.instructions is not None:
            self.instructions = self.request.instructions  # omitted: the chain's instructions carry over
        # Retained from now until the row lands, so the instance outlives its pending persist (REG-6).
        retention = engine.retain(permit.instance_id)
        try:
            _check_weights(parent, alias.name, retention)
        except ChainError:
            retention.release()
            raise
        self.alias, self.retention = alias, retention
        await live_responses.started(self.response_id, self.owner_id)
        cache = CacheScope(
            salt=self.request.cache_salt,
            prompt_cache_key=self.request.prompt_cache_key,
            instructions=self.instructions or "",
            previous_response_id=self.request.previous_response_id,
            keep_on_disk=self.request.store,
        )
        # The chain's images, this turn's and its parents', decoded for the model (issue 29).
        messages = await turn_images(alias, self.messages())
        return TurnRequest(
            turn.model,
            turn.owner_id,
            turn.sampling,
            messages=messages,
            cache=cache,
            effort=self.request.effort,
            **_structure(self.request),
        )

    def refused(self) -> None:
        live_responses.ended(self.response_id)
        if self.retention is not None:
            self.retention.release()

    def ended(self, result: TurnResult) -> asyncio.Future[None] | None:
        """Store the turn (when `store` is true) and let the instance go once the row lands.

        Returns the persist handoff, which the turn awaits before its terminal event (PER-1).
        """
        live_responses.ended(self.response_id)
        retention = self.retention
        assert retention is not None and self.alias is not None, "ended() after prepare()"
        if not self.request.store:
            retention.release()
            return None
        return persistence().record(
            self._record(result, retention),
            on_settled=retention.release,
            on_force_release=retention.retire,
            on_late_landing=retention.settle_late,
        )

    def _record(self, result: TurnResult, retention: Retention) -> ResponseRecord:
        request, alias = self.request, self.alias
        assert alias is not None
        status = response_status(result.event)
        done = result.event if isinstance(result.event, Done) else None
        usage = done.usage if done is not None else None
        return ResponseRecord(
            public_id=self.response_id,
            owner_id=self.owner_id,
            alias_id=alias.pk,
            alias_name=alias.name,
            instance_id=retention.instance_id,
            weights_fingerprint=retention.fingerprint,
            weights_key=retention.weights_key,
            boot_id=BOOT_ID,
            previous_response_id=request.previous_response_id or "",
            request={
                "input": self.turns,
                "instructions": self.instructions,
                "conversation": self.conversation,
                "metadata": dict(request.metadata),
                "max_output_tokens": request.max_output_tokens,
                "temperature": request.temperature,
                "top_p": request.top_p,
                # The server's figures for the turn, so the chat page shows them after a reload.
                "timings": done.timings.as_body() if done is not None else None,
                "session_cache": result.session_cache or None,
            },
            output=output_items(
                self.response_id, result.text, status, done, namespaced=dict(request.namespaced)
            ),
            output_text=result.text,
            usage=usage_body(usage) or {},
            status=status,
            retention_s=request.retention_s or 0,
            created_at=self.created_at,
        )


@dataclass
class StartedResponse:
    """A Responses turn the lane admitted, with the instructions its chain resolved to."""

    turn: StartedTurn
    instructions: str | None


def _structure(request: ResponseRequest) -> dict[str, Any]:
    """The tools, tool choice and JSON format of a Responses turn, as TurnRequest fields."""
    return {
        "tools": request.tools,
        "tool_choice": request.tool_choice,
        "json_format": request.json_format,
        "format_param": "text.format",
    }


async def response_start(
    request: ResponseRequest,
    owner_id: int,
    *,
    key: KeyIdentity | None = None,
    response_id: str | None = None,
    on_queued: Callable[[int], Awaitable[None]] | None = None,
) -> StartedResponse:
    """Start the Responses turn `request` asks for: take a lane permit, load
    the stored chain, check the weights, retain the instance, submit, and wait for admission.

    Raises:
        RateLimitedError: `key` is over one of its limits (KEY-4).
        ChainError: the parent is missing, failed, or came from other weights (REG-4).
        EngineError: refused by the lane or the engine (429/503 via the error table).
        ModelAlias.DoesNotExist: no enabled alias has that name.
    """
    response_id = response_id or new_response_id()
    hooks = ResponseHooks(request, owner_id, response_id)
    # The tools and format ride along from the start: their grammars are checked before the
    # permit (`turn_start`), the chain only adds messages.
    turn = TurnRequest(
        model=request.model, owner_id=owner_id, sampling=request.sampling, key=key, **_structure(request)
    )
    started = await turn_start(turn, request_id=response_id, hooks=hooks, on_queued=on_queued)
    hooks.created_at = started.started_at
    return StartedResponse(started, hooks.instructions)
