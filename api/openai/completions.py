"""OpenAI legacy text completions: POST /v1/completions, its input, `text_completion` shapes and SSE."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, HttpResponse
from rest_framework import serializers

from api import lookups
from api.auth import api_endpoint, json_body
from api.collect import collect_text
from api.errors import cut_short_error, error_body, failed_error
from api.openai.chat import FINISH_REASONS, ChatTurn, usage_body
from api.openai.serializers import MAX_TOP_K, ChatCompletionInput, StreamOptionsInput, StrictBooleanField
from api.openai.views import chat_shaped_response, validated
from api.sse import SSE_DONE, sse_event
from mlxhost.engine import Delta, Done, Engine, Failed, Generation, GenerationRequest
from mlxhost.runtime.control import engine_for
from models_app import selectors
from models_app.models import ModelAlias

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint, not the alias's
OBJECT = "text_completion"
UNSUPPORTED = {
    "echo": "echo is not supported by this server.",
    "suffix": "suffix (insertion) is not supported by this server.",
    "logprobs": "logprobs are not supported by this server.",
}


class CompletionInput(serializers.Serializer):
    model = serializers.CharField(max_length=64)
    prompt = serializers.JSONField()
    stream = StrictBooleanField(required=False, default=False)
    stream_options = StreamOptionsInput(required=False, allow_null=True)
    max_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=2.0)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    top_k = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_TOP_K)
    min_p = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    repetition_penalty = serializers.FloatField(
        required=False, allow_null=True, min_value=0.01, max_value=10.0
    )
    presence_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2.0, max_value=2.0)
    frequency_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2.0, max_value=2.0)
    stop = serializers.JSONField(required=False, allow_null=True)
    seed = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=2**63 - 1)
    n = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1)
    best_of = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=1)
    logit_bias = serializers.DictField(
        child=serializers.FloatField(min_value=-100, max_value=100), required=False, allow_null=True
    )
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)
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

    # The same rules as on chat completions.
    validate_stop = ChatCompletionInput.validate_stop
    validate_logit_bias = ChatCompletionInput.validate_logit_bias

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, message in UNSUPPORTED.items():
            if self.initial_data.get(name):  # echo=false, suffix="" and logprobs=0 are no-ops
                raise serializers.ValidationError({name: message})
        if attrs.get("max_tokens") is None:
            attrs["max_tokens"] = DEFAULT_MAX_TOKENS
        return attrs


def _completion_request(
    alias: ModelAlias, data: dict[str, Any], request_id: str, tenant: str, engine: Engine
) -> GenerationRequest:
    # The raw prompt is encoded without a chat template; prefix reuse works on its tokens (SES-8).
    session = engine.scoper.query(
        tenant=tenant, salt=data.get("cache_salt"), prompt_cache_key=data.get("prompt_cache_key")
    )
    return GenerationRequest(
        request_id=request_id,
        sampling=selectors.sampling_params_for(alias=alias, overrides=data),
        prompt=data["prompt"],
        binding=alias.name,
        max_input_tokens=alias.max_input_tokens,
        session=session,
    )


def _body(turn: ChatTurn, text: str, finish_reason: str | None) -> dict[str, Any]:
    body = turn.envelope(OBJECT)
    body["choices"] = [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]
    return body


async def completion_sse(turn: ChatTurn, generation: Generation) -> AsyncIterator[bytes]:
    """Stream `text_completion` chunks, then usage when asked for, then `data: [DONE]`.

    An async generator on purpose: Django buffers sync iterators under ASGI, and a client
    disconnect cancels this generator, which stops the generation (LANE-6).
    """
    usage_field = {"usage": None} if turn.include_usage else {}
    async for event in generation.stream():
        if isinstance(event, Delta) and event.text:
            yield sse_event({**_body(turn, event.text, None), **usage_field})
        elif isinstance(event, Done) and (cut := cut_short_error(event)) is not None:
            yield sse_event(error_body(cut, "openai"))  # cut short: never a finish_reason
        elif isinstance(event, Done):
            finish = FINISH_REASONS.get(event.finish_reason, "stop")
            yield sse_event({**_body(turn, "", finish), **usage_field})
            if turn.include_usage:
                yield sse_event({**turn.envelope(OBJECT), "choices": [], "usage": usage_body(event.usage)})
        elif isinstance(event, Failed):
            yield sse_event(error_body(failed_error(event), "openai"))
    yield SSE_DONE


async def completion_collect(turn: ChatTurn, generation: Generation) -> dict[str, Any]:
    """Collect a generation into one `text_completion` object.

    Raises:
        ApiError: 500 when the model failed mid-generation.
    """
    text, done = await collect_text(generation)
    body = _body(turn, text, FINISH_REASONS.get(done.finish_reason, "stop"))
    body["usage"] = usage_body(done.usage)
    return body


@api_endpoint(dialect="openai", methods=("POST",))
async def completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/completions (OpenAI legacy text completion; SSE when `stream` is true)."""
    body = json_body(request)
    data = validated(CompletionInput, body)
    alias = await lookups.alias_resolve(data["model"])
    request_id = f"cmpl-{secrets.token_hex(12)}"
    engine = await engine_for(alias.name)
    tenant = str(request.tenant_id)  # type: ignore[attr-defined]
    generation = await engine.submit(_completion_request(alias, data, request_id, tenant, engine))
    await generation.admitted()  # a queue timeout or drain is a status code, before any header
    return await chat_shaped_response(
        data, alias, request_id, generation, stream=completion_sse, collect=completion_collect
    )
