"""POST /v1/embeddings with the real all-MiniLM-L6-v2 (API-13, API-14): shapes, formats, errors, lanes."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxhost.runtime import get_engine
from tests.api.support import HELLO, bearer, post_any, post_json, save_alias, set_lane

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

REFERENCE = Path(__file__).resolve().parent.parent / "fixtures" / "embeddings" / "minilm_reference.json"
WIDTH = 384


async def embed(api_key: str, **fields):
    return await post_json("/v1/embeddings", {"model": "minilm", **fields}, bearer(api_key))


def vectors(response) -> list[list[float]]:
    assert response.status_code == 200, response.content
    return [item["embedding"] for item in response.json()["data"]]


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status, response.content
    return response.json()["error"]


async def test_vectors_match_the_sentence_transformers_reference(minilm_alias, api_key, mlx_engine):
    """API-14: every vector is within 1e-4 cosine distance of sentence-transformers' (PyTorch)
    for the same model, over 24 sentences in one request; similar sentences score higher."""
    reference = json.loads(REFERENCE.read_text())
    sentences, expected = reference["sentences"], reference["vectors"]
    assert len(sentences) >= 20
    got = vectors(await embed(api_key, input=sentences))
    distances = [1 - cosine(a, b) for a, b in zip(got, expected, strict=True)]
    assert max(distances) < 1e-4, distances
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-4) for v in got)
    # Sentences 2k and 2k+1 say the same thing (the first 16); each pair beats every other pairing.
    for k in range(0, 16, 2):
        same = cosine(got[k], got[k + 1])
        others = [cosine(got[k], got[j]) for j in range(16) if j not in (k, k + 1)]
        assert same > max(others), (sentences[k], same, max(others))


@pytest.mark.parametrize(
    ("value", "count"),
    [
        pytest.param("The cat sits on the mat.", 1, id="string"),
        pytest.param(["The cat sits on the mat.", "hello"], 2, id="strings"),
        pytest.param([791, 8415, 23874, 389, 279, 5634, 13], 1, id="token-array"),
        pytest.param([[791, 8415, 23874, 389, 279, 5634, 13], [15339]], 2, id="token-arrays"),
    ],
)
async def test_every_input_shape(minilm_alias, api_key, mlx_engine, value, count):
    """API-14: a string, strings, a token array and token arrays (cl100k_base, as OpenAI's
    tokenizer and LangChain write them) each give one vector per input, with usage."""
    response = await embed(api_key, input=value)
    body = response.json()
    assert [item["index"] for item in body["data"]] == list(range(count))
    assert all(item["object"] == "embedding" and len(item["embedding"]) == WIDTH for item in body["data"])
    assert body["object"] == "list" and body["model"] == "minilm"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


async def test_token_arrays_embed_as_the_text_they_encode(minilm_alias, api_key, mlx_engine):
    """API-14: cl100k_base ids are read back as text, so they give the text's own vector."""
    text = vectors(await embed(api_key, input="The cat sits on the mat."))[0]
    tokens = vectors(await embed(api_key, input=[791, 8415, 23874, 389, 279, 5634, 13]))[0]
    assert cosine(text, tokens) > 0.99999


async def test_base64_decodes_to_the_float_vectors(minilm_alias, api_key, mlx_engine):
    """API-14: `encoding_format: base64` is little-endian float32, equal to the float answer."""
    texts = ["hello", "a second, longer input"]
    floats = vectors(await embed(api_key, input=texts))
    encoded = vectors(await embed(api_key, input=texts, encoding_format="base64"))
    for number, blob in zip(floats, encoded, strict=True):
        raw = base64.b64decode(blob)
        assert len(raw) == 4 * WIDTH
        assert list(struct.unpack(f"<{WIDTH}f", raw)) == number


async def test_dimensions_on_a_matryoshka_model_truncate_and_renormalise(minilm_alias, api_key, mlx_engine):
    """API-14: fewer `dimensions` is a 400 on an ordinary model; marked Matryoshka, the vector is
    its first numbers renormalised; the model's own width always works; more is a 400."""
    full = vectors(await embed(api_key, input="hello", dimensions=WIDTH))[0]
    refused = error_of(await embed(api_key, input="hello", dimensions=64))
    assert refused["param"] == "dimensions" and "Matryoshka" in refused["message"]
    await save_alias(minilm_alias, matryoshka=True)
    short = vectors(await embed(api_key, input="hello", dimensions=64))[0]
    norm = math.sqrt(math.fsum(x * x for x in full[:64]))
    assert short == pytest.approx([x / norm for x in full[:64]], abs=1e-6)
    assert error_of(await embed(api_key, input="hello", dimensions=WIDTH + 1))["param"] == "dimensions"


@pytest.mark.parametrize(
    ("value", "param"),
    [
        pytest.param("", "input", id="empty-string"),
        pytest.param([], "input", id="empty-list"),
        pytest.param(["ok", ""], "input[1]", id="empty-item"),
        pytest.param(["ok", [1, 2], 3], "input[2]", id="mixed-shapes"),
        pytest.param({"text": "hi"}, "input", id="object"),
        pytest.param([[1, 2], [100256]], "input[1]", id="unknown-token"),
        pytest.param([-1], "input[0]", id="negative-token"),
        pytest.param([2**70], "input[0]", id="huge-token"),
        pytest.param([[]], "input[0]", id="empty-token-array"),
        pytest.param([1.5, 2], "input[0]", id="floats"),
        pytest.param([["a"]], "input[0]", id="strings-in-a-list"),
    ],
)
async def test_bad_inputs_are_400s_naming_the_input(minilm_alias, api_key, mlx_engine, value, param):
    """API-4, API-14: a malformed or empty input is a 400 in OpenAI's envelope naming it."""
    error = error_of(await embed(api_key, input=value))
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({"dimensions": 0}, "dimensions", id="zero-dimensions"),
        pytest.param({"dimensions": "many"}, "dimensions", id="text-dimensions"),
        pytest.param({"encoding_format": "binary"}, "encoding_format", id="unknown-format"),
        pytest.param({"input": None}, "input", id="null-input"),
    ],
)
async def test_bad_fields_are_400s_naming_them(minilm_alias, api_key, mlx_engine, fields, param):
    """API-4: every other field is checked too, and named."""
    error = error_of(await embed(api_key, **{"input": "hello", **fields}))
    assert error["param"] == param


async def test_an_input_over_the_model_limit_is_a_400_naming_its_index(minilm_alias, api_key, mlx_engine):
    """API-14: all-MiniLM-L6-v2 reads 256 tokens; a longer input is refused by index, never cut."""
    error = error_of(await embed(api_key, input=["short", "fine", "short", "word " * 300]))
    assert error["param"] == "input[3]"
    assert "256" in error["message"]


async def test_chat_and_embedding_aliases_refuse_each_others_endpoints(
    minilm_alias, tiny_alias, api_key, mlx_engine
):
    """API-13: an embedding alias on every chat surface, and a chat alias on /v1/embeddings, are a
    400 in that surface's envelope saying why."""
    wrong = error_of(await post_json("/v1/embeddings", {"model": "tiny", "input": "hi"}, bearer(api_key)))
    assert (wrong["code"], wrong["param"]) == ("wrong_model_kind", "model")
    assert "chat model" in wrong["message"]
    chat_bodies = {
        "/v1/chat/completions": {"model": "minilm", "messages": HELLO},
        "/v1/completions": {"model": "minilm", "prompt": "hi"},
        "/v1/responses": {"model": "minilm", "input": "hi"},
    }
    for path, body in chat_bodies.items():
        error = error_of(await post_any(api_key, path, body))
        assert error["code"] == "wrong_model_kind", path
        assert "/v1/embeddings" in error["message"], path
    messages = await post_any(
        api_key, "/v1/messages", {"model": "minilm", "max_tokens": 8, "messages": HELLO}
    )
    assert messages.status_code == 400
    assert messages.json()["type"] == "error"
    assert "embedding model" in messages.json()["error"]["message"]


async def test_a_full_lane_is_a_429_with_retry_after(minilm_alias, api_key, mlx_engine):
    """LANE-2, API-14: over the lane's budget an embedding request is refused at once with 429."""
    await set_lane(minilm_alias, concurrency=1, queue_depth=0)
    vectors(await embed(api_key, input="warm up"))  # bound and loaded
    permit = get_engine().reserve("holder", "minilm")  # the one place the budget has
    try:
        response = await embed(api_key, input="hello")
    finally:
        permit.release()
    error = error_of(response, 429)
    assert (error["code"], error["type"]) == ("queue_full", "rate_limit_error")
    assert int(response["Retry-After"]) >= 1
    vectors(await embed(api_key, input="hello"))


async def test_concurrent_requests_are_batched_and_counted(minilm_alias, api_key, mlx_engine):
    """API-14, OPS-1: concurrent requests share forward passes; metrics count them per alias."""
    texts = [[f"sentence {i} of request {r}" for i in range(4)] for r in range(6)]
    responses = await asyncio.gather(*(embed(api_key, input=t) for t in texts))
    assert all(len(vectors(r)) == 4 for r in responses)
    [snap] = [s for s in get_engine().snapshot() if s["kind"] == "embedding"]
    assert snap["embeddings"]["inputs"] == 24
    assert snap["embeddings"]["passes"] < 6  # fewer passes than requests
    samples = [
        s
        for family in text_string_to_metric_families((await post_metrics(api_key)).decode())
        for s in family.samples
    ]
    done = [
        s for s in samples if s.name == "mlxhost_embedding_requests_total" and s.labels["model"] == "minilm"
    ]
    assert {s.labels["outcome"]: s.value for s in done if s.value} == {"completed": 6.0}
    assert all("instance" in s.labels for s in done)
    assert sum(s.value for s in samples if s.name == "mlxhost_embedding_inputs_total") == 24


async def post_metrics(api_key: str) -> bytes:
    from django.test import AsyncClient

    response = await AsyncClient().get("/metrics", headers=bearer(api_key))
    assert response.status_code == 200
    return response.content


async def test_the_websocket_refuses_an_embedding_alias_and_stays_open(
    minilm_alias, tiny_alias, api_key, mlx_engine
):
    """API-13, API-3: a `response.create` naming an embedding alias is a 400 error frame saying why;
    the socket stays open for the next turn."""
    from tests.api.support import WS_TERMINAL, connect, frames_until, key_headers, ws_create

    socket = await connect(key_headers(api_key))
    await ws_create(socket, model="minilm", input="Hi", max_output_tokens=2, store=False)
    frame = json.loads(await socket.receive_from(timeout=10))
    assert (frame["type"], frame["status"], frame["error"]["code"]) == ("error", 400, "wrong_model_kind")
    await ws_create(socket, model="tiny", input="Hi", max_output_tokens=2, store=False)
    assert (await frames_until(socket, *WS_TERMINAL))[-1]["type"] == "response.incomplete"
    await socket.disconnect()
