"""Anthropic's shape of the model list: what `anthropic.Anthropic().models.list()` reads."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.http import HttpRequest


def wants_anthropic(request: HttpRequest) -> bool:
    """Whether the caller is an Anthropic client: its SDK sends `anthropic-version` on every request."""
    return "anthropic-version" in request.headers


def model_info(item: dict[str, Any]) -> dict[str, Any]:
    """One entry of `GET /v1/models` (OpenAI's shape) as Anthropic's `ModelInfo`, keeping mlxhost's
    `state` (REG-8), which SDKs ignore."""
    created = datetime.fromtimestamp(item["created"], tz=UTC).isoformat().replace("+00:00", "Z")
    return {
        "type": "model",
        "id": item["id"],
        "display_name": item["id"],
        "created_at": created,
        "state": item["state"],
    }


def model_page(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole list as one Anthropic page (every enabled alias fits in it)."""
    data = [model_info(item) for item in items]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
