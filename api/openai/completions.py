"""OpenAI legacy text completions: POST /v1/completions, its input, `text_completion` shapes and SSE."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from rest_framework import serializers

from api.auth import Caller, api_endpoint, caller_of
from api.collect import collect_answers
from api.errors import cut_short_error
from api.openai.chat import (
    CUT_SHORT_FINISH,
    FINISH_REASONS,
    ChatTurn,
    choices_sse,
    choices_usage,
    usage_body,
)
from api.openai.serializers import (
    StreamOptionsInput,
    StrictBooleanField,
    TextSamplingInput,
    choices_count,
    choices_field,
)
from api.openai.views import body_for_turn, chat_shaped_response, validated
from api.sampling import sampling_overrides
from api.sse import sse_event
from mlxhost.engine import Delta, Done, Failed, Generation, TokenLogprob
from models_app.turns.turns import CacheScope, TurnRequest, turn_start

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from django.http import HttpRequest, HttpResponseBase

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint, not the alias's
OBJECT = "text_completion"
UNSUPPORTED = {
    "echo": "echo is not supported by this server.",
    "suffix": "suffix (insertion) is not supported by this server.",
}
MAX_LEGACY_LOGPROBS = 5  # the legacy endpoint's own bound


class CompletionInput(TextSamplingInput):
    prompt = serializers.JSONField()
    stream = StrictBooleanField(required=False, default=False)
    stream_options = StreamOptionsInput(required=False, allow_null=True)
    n = choices_field()
    best_of = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)
    logprobs = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=MAX_LEGACY_LOGPROBS
    )
    # Warm-session scoping (SES-2/3), as on chat completions: only fingerprints are kept.
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, max_length=1024)
    cache_salt = serializers.CharField(required=False, allow_null=True, max_length=1024)

    def validate_prompt(self, value: Any) -> str:
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, list):
            raise serializers.ValidationError("Only one prompt per request is supported.")
        if not isinstance(value, str):
            raise serializers.ValidationError("prompt must be a string (token-id prompts are not supported).")
        if not value:
            raise serializers.ValidationError("prompt must not be empty.")
        return value

    def validate_n(self, value: int | None) -> int:
        return choices_count(value)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs["n"] = attrs.get("n") or 1
        for name, message in UNSUPPORTED.items():
            if self.initial_data.get(name):  # echo=false and suffix="" are no-ops
                raise serializers.ValidationError({name: message})
        if attrs.get("max_tokens") is None:
            attrs["max_tokens"] = DEFAULT_MAX_TOKENS
        return attrs


def _completion_turn(data: dict[str, Any], caller: Caller) -> TurnRequest:
    # The raw prompt is encoded without a chat template; prefix reuse works on its tokens (SES-8).
    cache = CacheScope(salt=data.get("cache_salt"), prompt_cache_key=data.get("prompt_cache_key"))
    return TurnRequest(
        data["model"],
        caller.owner_id,
        sampling_overrides(data),
        prompt=data["prompt"],
        cache=cache,
        key=caller.key,
    )


def _body(
    turn: ChatTurn,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    body = turn.envelope(OBJECT)
    body["choices"] = [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}]
    return body


def legacy_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Logprobs in the legacy completions shape: parallel lists, alternatives as token -> logprob,
    and each token's character offset in the text (from `offset`)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


async def completion_sse(turn: ChatTurn, generations: Sequence[Generation]) -> AsyncIterator[bytes]:
    """Stream `text_completion` chunks of every choice (each with its `index`), then the usage
    of them all when asked for, then the first error if any, then `data: [DONE]`.

    An async generator on purpose: Django buffers sync iterators under ASGI, and a client
    disconnect cancels this generator, which stops every choice's generation (LANE-6).
    """
    async for frame in choices_sse(turn, generations, _choice_sse, OBJECT):
        yield frame


async def _choice_sse(
    turn: ChatTurn, generation: Generation, index: int, endings: list[Done | Failed | None]
) -> AsyncIterator[bytes]:
    """One choice's chunks, up to its finish chunk; how it ended goes to `endings[index]`."""
    usage_field = {"usage": None} if turn.include_usage else {}
    offset = 0
    async for event in generation.stream():
        if isinstance(event, Delta) and (event.text or event.logprobs):
            logprobs = legacy_logprobs(list(event.logprobs), offset) if event.logprobs else None
            offset += len(event.text)
            yield sse_event({**_body(turn, event.text, None, logprobs, index), **usage_field})
        elif isinstance(event, Done):
            endings[index] = event
            # Cut short: "abort", then (after every choice) the error that says why.
            finish = (
                CUT_SHORT_FINISH
                if cut_short_error(event)
                else FINISH_REASONS.get(event.finish_reason, "stop")
            )
            yield sse_event({**_body(turn, "", finish, index=index), **usage_field})
        elif isinstance(event, Failed):
            endings[index] = event


async def completion_collect(turn: ChatTurn, generations: Sequence[Generation]) -> dict[str, Any]:
    """Collect a request's choices into one `text_completion` object.

    Raises:
        ApiError: 500 when the model failed mid-generation (as `collect_answers`).
    """
    answers = await collect_answers(generations)
    body = turn.envelope(OBJECT)
    choices = []
    for index, (answer, generation) in enumerate(zip(answers, generations, strict=True)):
        logprobs = (
            legacy_logprobs(answer.logprobs) if generation.request.sampling.logprobs is not None else None
        )
        finish = FINISH_REASONS.get(answer.done.finish_reason, "stop")
        choices.extend(_body(turn, answer.text, finish, logprobs, index)["choices"])
    body["choices"] = choices
    body["usage"] = usage_body(choices_usage([answer.done.usage for answer in answers]))
    return body


@api_endpoint(dialect="openai", methods=("POST",), names={"messages": "prompt"})
async def completions(request: HttpRequest) -> HttpResponseBase:
    """POST /v1/completions (OpenAI legacy text completion; SSE when `stream` is true)."""
    data = validated(CompletionInput, await body_for_turn(request))
    # Admitted before any header goes out: a queue timeout or drain is a status code.
    turn = await turn_start(
        _completion_turn(data, caller_of(request)),
        request_id=f"cmpl-{secrets.token_hex(12)}",
        choices=data["n"],
    )
    return await chat_shaped_response(data, turn, stream=completion_sse, collect=completion_collect)
