"""The Responses use case's input: a validated Responses body in the turn service's terms.

The API builds one from its `ResponsesInput` body (`api.openai.responses_input.response_request`)
and hands it to `response_turns.response_start`; nothing changes it afterwards (the chain's
resolved turns live on the turn's hooks, not here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxhost.engine import Tool, ToolChoice

if TYPE_CHECKING:
    from collections.abc import Mapping


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseRequest:
    """One Responses turn as the client asked for it, validated (API-1, API-3)."""

    model: str  # the alias name
    turns: tuple[Mapping[str, Any], ...]  # the input, in the engine's roles; references not yet resolved
    # Sampling overrides in the engine's names (`api.sampling.SAMPLING_KEYS`).
    sampling: Mapping[str, Any] = field(default_factory=dict)
    instructions: str | None = None  # None: omitted, so the chain's instructions carry over
    previous_response_id: str | None = None
    store: bool = True
    metadata: Mapping[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    retention_s: int | None = None  # how long the stored row is kept (None: the default)
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    effort: str | None = None  # `reasoning.effort` (API-9)
    tools: tuple[Tool, ...] = ()
    # A namespaced function's offered name -> (namespace, name), as its calls go back.
    namespaced: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)  # `single` when parallel calls are off
    json_format: str | None = None  # `text.format`: None text, "" any JSON object, else a schema's text
