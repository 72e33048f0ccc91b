"""`GET /v1/responses/{id}/input_items`: a stored turn's input as OpenAI's paged list of items."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api.errors import ApiError

if TYPE_CHECKING:
    from django.http import QueryDict

DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def input_item_id(response_id: str, index: int) -> str:
    """The id of a stored turn's `index`th input item (stable, so it can be a cursor)."""
    return f"msg_{response_id.removeprefix('resp_')}_{index}"


IMAGE_URL_INCLUDE = "message.input_image.image_url"


def input_items(
    response_id: str, turns: list[dict[str, Any]], *, image_urls: bool = False
) -> list[dict[str, Any]]:
    """The stored input turns as items, oldest first: messages (assistant text is `output_text`,
    a user's images `input_image` parts after the text, with their data URLs when `image_urls`),
    an assistant's calls as `function_call` items after its text, results as `function_call_output`."""
    items: list[dict[str, Any]] = []
    hex_id = response_id.removeprefix("resp_")
    for index, turn in enumerate(turns):
        if turn["role"] == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "id": f"fco_{hex_id}_{index}",
                    "call_id": turn.get("tool_call_id", ""),
                    "output": turn["content"],
                    "status": "completed",
                }
            )
            continue
        calls = turn.get("tool_calls") or []
        if turn["content"] or not calls:
            part: dict[str, Any] = {"type": "input_text", "text": turn["content"]}
            if turn["role"] == "assistant":
                part = {"type": "output_text", "text": turn["content"], "annotations": []}
            parts = [part] if turn["content"] or not turn.get("images") else []
            parts += [_image_part(image, image_urls) for image in turn.get("images") or ()]
            items.append(
                {
                    "type": "message",
                    "id": input_item_id(response_id, index),
                    "role": turn["role"],
                    "status": "completed",
                    "content": parts,
                }
            )
        for k, call in enumerate(calls):
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{hex_id}_{index}_{k}",
                    "call_id": call["id"],
                    "name": call["name"],
                    "arguments": call["arguments"],
                    "status": "completed",
                }
            )
    return items


def _image_part(image: dict[str, str], with_url: bool) -> dict[str, Any]:
    url = f"data:{image.get('media_type') or 'application/octet-stream'};base64,{image['data']}"
    return {"type": "input_image", "detail": "auto", "file_id": None, "image_url": url if with_url else None}


def _limit(query: QueryDict) -> int:
    raw = query.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    # ASCII only: "²".isdigit() is true, and int() refuses it.
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIMIT:
        raise ApiError(
            400, f"limit must be an integer from 1 to {MAX_LIMIT}.", code="invalid_value", param="limit"
        )
    return int(raw)


def _cut(items: list[dict[str, Any]], query: QueryDict, name: str) -> list[dict[str, Any]]:
    cursor = query.get(name)
    if cursor is None:
        return items
    ids = [item["id"] for item in items]
    if cursor not in ids:
        raise ApiError(
            400, f"{name}: no input item {cursor!r} in this response.", code="invalid_value", param=name
        )
    at = ids.index(cursor)
    return items[at + 1 :] if name == "after" else items[:at]


def input_items_page(items: list[dict[str, Any]], query: QueryDict) -> dict[str, Any]:
    """One page of `items` as OpenAI lists them: `order` (`desc`, newest first, by default),
    `limit` (1 to 100, default 20), and the `after` / `before` cursors, in that order.

    Raises:
        ApiError: 400 naming the query parameter that is not valid.
    """
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'.", code="invalid_value", param="order")
    limit = _limit(query)
    ordered = items if order == "asc" else items[::-1]
    window = _cut(_cut(ordered, query, "after"), query, "before")
    page = window[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(window) > limit,
    }
