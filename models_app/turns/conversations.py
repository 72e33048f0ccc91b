"""Reads for stored conversations: rebuild a chain from its last row, and check it may continue (REG-4)."""

from __future__ import annotations

from typing import Any

from models_app.models import StoredResponse

CONTINUABLE = {
    StoredResponse.Status.COMPLETED,
    StoredResponse.Status.INCOMPLETE,
    StoredResponse.Status.CANCELLED,
}


NAMESPACE_JOIN = "__"


def namespaced_name(namespace: str | None, name: str) -> str:
    """The name a model calls a namespaced function by (Codex's `namespace` tools): `ns__name`."""
    return f"{namespace}{NAMESPACE_JOIN}{name}" if namespace else name


def conversation_of(*, parent: StoredResponse) -> tuple[str | None, list[dict[str, Any]]]:
    """The parent's instructions and every turn through its answer, as role/content dicts (an
    assistant turn may carry `tool_calls`, a "tool" turn the `tool_call_id` it answers).

    Each row stores the whole conversation it answered, so a continuation reads one row,
    never a chain of them, and a cold replay rebuilds exactly what the warm session held.
    """
    request: dict[str, Any] = parent.request or {}
    turns = [dict(turn) for turn in request.get("conversation", [])]
    answer: dict[str, Any] = {"role": "assistant", "content": parent.output_text}
    calls = [
        {
            "id": item["call_id"],
            "name": namespaced_name(item.get("namespace"), item["name"]),
            "arguments": item["arguments"],
        }
        for item in parent.output or []
        if item.get("type") == "function_call"
    ]
    if calls:
        answer["tool_calls"] = calls
    turns.append(answer)
    return request.get("instructions"), turns


def response_same_weights(
    *, parent: StoredResponse, live_instance_id: int, fingerprint: str, boot_id: str
) -> bool:
    """Whether the alias still serves the weights that produced `parent` (REG-4).

    Within one boot instance ids are live and compared directly (an alias of the same
    instance passes). Across boots or processes an id proves nothing, so the weights
    fingerprint decides: a swapped model never replays a foreign chain.
    """
    if parent.boot_id == boot_id:
        return parent.instance_id == live_instance_id
    return bool(parent.weights_fingerprint) and parent.weights_fingerprint == fingerprint
