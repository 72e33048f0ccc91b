"""Responses `item_reference` inputs: an earlier turn named by the id of one of its stored items.

The Vercel AI SDK sends the assistant's previous answer as `{"type": "item_reference", "id":
"msg_…"}` instead of its text. Two kinds of id resolve, both tenant-scoped (PER-6):
- `msg_<hex>`: the output message of the stored response `resp_<hex>` (its answer);
- `msg_<hex>_<i>`: that response's `i`th input item, as `input_items` lists it;
- `fc_<hex>_<i>`: that response's `i`th function call (its output item), which joins the
  assistant turn before it as one of its calls.
"""

from __future__ import annotations

import re
from typing import Any

from models_app.models import StoredResponse
from models_app.persistence.persistence import persistence

REFERENCE_ROLE = "item_reference"  # the placeholder turn `responses_input.input_turns` leaves
_ITEM_ID = re.compile(r"msg_([0-9a-f]{1,60})(?:_(\d{1,6}))?")
_CALL_ID = re.compile(r"fc_([0-9a-f]{1,60})_(\d{1,6})")


class ItemNotFoundError(Exception):
    """An `item_reference` names no stored message item of the caller's."""

    def __init__(self, index: int, item_id: str) -> None:
        super().__init__(f"input[{index}]: no stored message or function_call item with id {item_id!r}.")
        self.param = f"input[{index}]"


def reference_turn(item_id: str) -> dict[str, str]:
    """The placeholder turn for a reference, resolved by `turns_resolved` under the lane permit."""
    return {"role": REFERENCE_ROLE, "content": "", "id": item_id}


async def turns_resolved(turns: list[dict[str, Any]], *, owner_id: int) -> list[dict[str, Any]]:
    """`turns` with each reference replaced by the role/content turn it names.

    Raises:
        ItemNotFoundError: a reference to a missing item, or to another tenant's (the same error).
        StorageTimeoutError: the referenced response is still being stored here (PER-2).
    """
    if not any(turn["role"] == REFERENCE_ROLE for turn in turns):
        return turns
    resolved: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        if turn["role"] == REFERENCE_ROLE:
            turn = await _turn_of(index, turn["id"], owner_id)
            previous = resolved[-1] if resolved else None
            if "tool_calls" in turn and not turn["content"] and previous and previous["role"] == "assistant":
                # One assistant turn; a new list, so the request's own turns stay as they came.
                previous["tool_calls"] = [*previous.get("tool_calls", []), *turn["tool_calls"]]
                continue
        resolved.append(dict(turn))
    return resolved


async def _turn_of(index: int, item_id: str, owner_id: int) -> dict[str, Any]:
    if (call := _CALL_ID.fullmatch(item_id)) is not None:
        return await _call_turn(index, item_id, call[1], owner_id)
    match = _ITEM_ID.fullmatch(item_id)
    if match is None:
        raise ItemNotFoundError(index, item_id)
    try:
        row = await persistence().fetch(public_id=f"resp_{match[1]}", owner_id=owner_id)
    except StoredResponse.DoesNotExist:
        raise ItemNotFoundError(index, item_id) from None
    if match[2] is not None:
        inputs: list[dict[str, str]] = (row.request or {}).get("input", [])
        position = int(match[2])
        if position >= len(inputs):
            raise ItemNotFoundError(index, item_id)
        return {"role": inputs[position]["role"], "content": inputs[position]["content"]}
    for item in row.output or []:
        if item.get("type") == "message" and item.get("id") == item_id:
            return {"role": "assistant", "content": _text_of(item)}
    raise ItemNotFoundError(index, item_id)


async def _call_turn(index: int, item_id: str, hex_id: str, owner_id: int) -> dict[str, Any]:
    try:
        row = await persistence().fetch(public_id=f"resp_{hex_id}", owner_id=owner_id)
    except StoredResponse.DoesNotExist:
        raise ItemNotFoundError(index, item_id) from None
    for item in row.output or []:
        if item.get("type") == "function_call" and item.get("id") == item_id:
            call = {"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
    raise ItemNotFoundError(index, item_id)


def _text_of(item: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "") for part in item.get("content", []) if part.get("type") == "output_text"
    )
