"""Template tags for the admin's own pages: the admin index's "models up" summary (ADM-7)."""

from __future__ import annotations

from typing import Any

from django import template

from models_app.console import live_state

register = template.Library()


@register.inclusion_tag("admin/models_app/_models_up.html")
def models_up_summary() -> dict[str, Any]:
    """How many models are up now, linking to the live Models page."""
    return {"summary": live_state.models_up()}
