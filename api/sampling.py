"""`SamplingInput`: the sampling fields and validators every generating surface shares.

Each surface's input serializer subclasses it. Where a surface's wire name differs from the
engine's (Anthropic `stop_sequences`, Responses `max_output_tokens`), the subclass declares the
wire field with `source=` the engine name, so `validated_data` always speaks the engine's names
(`sampling_overrides`) and errors still name the field the client sent. A field a surface does
not take is removed by setting it to None in the subclass (DRF's field removal).
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from api.fields import JsonInput
from mlxhost.engine import SAMPLING_KNOBS

MAX_STOP_SEQUENCES = 4
# The engine checks ids against the loaded vocabulary (mlxhost/engine/limits.py); these bounds
# refuse what no model could use before any work, as OpenAI does.
MAX_LOGIT_BIAS = 300
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
# The engine's names for what SamplingInput validates: the overrides `sampling_params_for` merges.
SAMPLING_KEYS = SAMPLING_KNOBS


def stop_list_field(max_length: int, **kwargs: Any) -> serializers.ListField:
    """A list of non-empty stop strings (whitespace kept), at most `max_length` of them."""
    return serializers.ListField(
        child=serializers.CharField(min_length=1, trim_whitespace=False),
        required=False,
        allow_null=True,
        max_length=max_length,
        **kwargs,
    )


def optional_float(low: float, high: float, **kwargs: Any) -> serializers.FloatField:
    return serializers.FloatField(required=False, allow_null=True, min_value=low, max_value=high, **kwargs)


def max_tokens_field(**kwargs: Any) -> serializers.IntegerField:
    return serializers.IntegerField(required=False, allow_null=True, min_value=1, **kwargs)


# A knob a surface may redeclare (`stop` as a string or a list) or drop: DRF removes a declared
# field that a subclass sets to None.
Knob = serializers.Field[Any, Any, Any, Any] | None


class SamplingInput(JsonInput):
    """The model name and the sampling knobs, with OpenAI's ranges (the widest any surface takes)."""

    model = serializers.CharField(max_length=64)
    temperature = optional_float(0.0, 2.0)
    top_p = optional_float(0.0, 1.0)
    top_k = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_TOP_K)
    min_p: Knob = optional_float(0.0, 1.0)
    repetition_penalty: Knob = optional_float(0.01, 10.0)
    presence_penalty: Knob = optional_float(-2.0, 2.0)
    frequency_penalty: Knob = optional_float(-2.0, 2.0)
    max_tokens: Knob = max_tokens_field()
    stop: Knob = stop_list_field(MAX_STOP_SEQUENCES)
    seed: Knob = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_SEED)
    logit_bias: Knob = serializers.DictField(
        child=serializers.FloatField(min_value=-100, max_value=100), required=False, allow_null=True
    )

    def validate_logit_bias(self, value: dict[str, float] | None) -> dict[int, float]:
        return logit_bias_tokens(value)


def sampling_overrides(data: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling values in the engine's names (None: the alias default applies).
    `logprobs` is the number of alternatives per token, set by the surfaces that take it."""
    return {name: data.get(name) for name in SAMPLING_KEYS}


def logit_bias_tokens(value: dict[str, float] | None) -> dict[int, float]:
    """`logit_bias` with integer token ids: at most MAX_LOGIT_BIAS of them, none negative."""
    value = value or {}
    if len(value) > MAX_LOGIT_BIAS:
        raise serializers.ValidationError(f"At most {MAX_LOGIT_BIAS} token ids.")
    try:
        tokens = {int(token): bias for token, bias in value.items()}
    except ValueError:
        raise serializers.ValidationError("logit_bias keys must be token ids.") from None
    if any(not 0 <= token <= MAX_TOKEN_ID for token in tokens):
        raise serializers.ValidationError("logit_bias keys must be token ids from 0 up.")
    return tokens
