"""Hostile request bodies on every POST surface: each is a 4xx in the surface's envelope (API-4)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from django.test import AsyncClient

from api import errors
from mlxhost.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True)]

SURFACES = [
    pytest.param("/v1/chat/completions", "openai", id="chat"),
    pytest.param("/v1/completions", "openai", id="completions"),
    pytest.param("/v1/responses", "openai", id="responses"),
    pytest.param("/v1/messages", "anthropic", id="messages"),
    pytest.param("/v1/messages/count_tokens", "anthropic", id="count-tokens"),
]
DEEP = b"[" * 10_000 + b"]" * 10_000
LONE_SURROGATE = (
    b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}], "prompt": "\\udfff"}'
)


async def post_raw(url: str, body: bytes, api_key: str):
    return await AsyncClient().post(
        url, data=body, content_type="application/json", headers={"Authorization": f"Bearer {api_key}"}
    )


def assert_envelope(response, status: int, dialect: str, code: str | None = None) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    if dialect == "anthropic":
        assert body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        if code is not None:
            assert body["error"]["code"] == code
    assert "Traceback" not in response.content.decode()
    return body["error"]


@pytest.mark.parametrize(("url", "dialect"), SURFACES)
async def test_json_nested_10000_deep_is_400_invalid_json(url, dialect, api_key):
    """API-4: 10,000-deep JSON (RecursionError in json.loads) is a 400, not a 500."""
    assert_envelope(await post_raw(url, DEEP, api_key), 400, dialect, "invalid_json")


@pytest.mark.parametrize(("url", "dialect"), SURFACES)
async def test_json_nested_past_the_depth_limit_is_400(url, dialect, api_key):
    """API-4: nesting json.loads accepts but later copies would choke on is refused too."""
    body = b'{"model": "tiny", "metadata": ' + b"[" * 500 + b"]" * 500 + b"}"
    assert_envelope(await post_raw(url, body, api_key), 400, dialect, "invalid_json")


@pytest.mark.parametrize(("url", "dialect"), SURFACES)
@pytest.mark.parametrize(
    "body",
    [
        pytest.param(LONE_SURROGATE, id="escaped"),
        pytest.param(b'{"model": "tiny", "x": "\xed\xa0\x80"}', id="raw-utf8-surrogate"),
        pytest.param(b'{"model": "tiny", "\\udc00": 1}', id="in-a-key"),
    ],
)
async def test_a_lone_utf16_surrogate_is_400(url, dialect, body, api_key):
    """API-4: lone surrogates crash later when encoded to UTF-8; they are refused at parse time."""
    assert_envelope(await post_raw(url, body, api_key), 400, dialect, "invalid_json")


async def test_a_valid_surrogate_pair_is_accepted(api_key):
    """An escaped pair is one real character (an emoji), not bad Unicode: parsing goes on."""
    body = b'{"model": "no-such-model", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    response = await post_raw("/v1/chat/completions", body, api_key)
    assert_envelope(response, 404, "openai", "model_not_found")


@pytest.mark.parametrize(("url", "dialect"), SURFACES)
async def test_a_body_over_the_limit_is_413_in_the_envelope(url, dialect, api_key, settings):
    """API-4: a body over MLXHOST_MAX_REQUEST_BYTES is 413 (Anthropic `request_too_large`), not 500."""
    settings.MLXHOST_MAX_REQUEST_BYTES = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    error = assert_envelope(await post_raw(url, body, api_key), 413, dialect, "request_too_large")
    if dialect == "anthropic":
        assert error["type"] == "request_too_large"


async def asgi_post_chunked(path: str, chunks: list[bytes], api_key: str) -> tuple[int, dict, bytes]:
    """POST through the ASGI app with no Content-Length (a chunked body), chunk by chunk."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"transfer-encoding", b"chunked"),
            (b"authorization", f"Bearer {api_key}".encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    sent: list[dict] = []
    answered = asyncio.Event()

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await answered.wait()  # Django listens for a disconnect while it answers
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


@pytest.mark.parametrize(("url", "dialect"), SURFACES)
async def test_a_chunked_body_over_the_limit_is_413_counting_the_bytes_read(url, dialect, api_key, settings):
    """API-4: without Content-Length the bytes actually read count against the limit."""
    settings.MLXHOST_MAX_REQUEST_BYTES = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    head = b'{"model": "tiny", "messages": [{"role": "user", "content": "'
    status, _, body = await asgi_post_chunked(url, [head, b"x" * 600, b"x" * 600, b'"}]}'], api_key)
    assert status == 413, body
    if dialect == "anthropic":
        assert json.loads(body)["error"]["type"] == "request_too_large"
    else:
        assert json.loads(body)["error"]["code"] == "request_too_large"


async def test_a_chunked_body_under_the_limit_is_read_whole(api_key, settings):
    """The chunked path still works for an acceptable body (here: an unknown model, 404)."""
    status, _, body = await asgi_post_chunked(
        "/v1/chat/completions",
        [b'{"model": "no-such-', b'model", "messages": [{"role": "user", "content": "hi"}]}'],
        api_key,
    )
    assert (status, json.loads(body)["error"]["param"]) == (404, "model")


@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        pytest.param("/v1/nope", "openai", id="openai"),
        pytest.param("/v1/messages/nope", "anthropic", id="anthropic"),
    ],
)
async def test_an_unknown_v1_route_is_a_json_404(path, dialect):
    """API-4: unknown routes under /v1/ answer the API's JSON envelope, not Django's HTML page."""
    for method in ("get", "post"):
        response = await getattr(AsyncClient(), method)(path)
        assert response["Content-Type"] == "application/json"
        assert_envelope(response, 404, dialect)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("get", "/v1/responses/%00%ff", id="retrieve"),
        pytest.param("delete", "/v1/responses/resp_%00", id="delete"),
        pytest.param("post", "/v1/responses/%00/cancel", id="cancel"),
        pytest.param("get", "/v1/responses/%00/input_items", id="input-items"),
        pytest.param("get", "/v1/models/%00", id="model"),
    ],
)
async def test_an_id_with_bytes_no_id_has_is_a_json_404_without_a_query(method, path, api_key):
    """API-4, PER-6: a NUL byte in a path id (PostgreSQL refuses it in a query: a 500 before) is
    the JSON 404 of an unknown id."""
    response = await getattr(AsyncClient(), method)(path, headers={"Authorization": f"Bearer {api_key}"})
    assert_envelope(response, 404, "openai")


async def test_an_unknown_internal_error_is_a_500_with_a_request_id_and_no_traceback(
    api_key, monkeypatch, caplog
):
    """API-4: a bug is a 500 with a fixed message and the request id (header and message); the
    traceback goes to the server log only, never to the client."""

    def explode(*args, **kwargs):
        raise RuntimeError("/secret/path/weights.safetensors exploded")

    monkeypatch.setattr("api.openai.views.validated", explode)
    with caplog.at_level(logging.ERROR, logger=errors.__name__):
        response = await post_raw("/v1/chat/completions", b'{"model": "tiny"}', api_key)
    error = assert_envelope(response, 500, "openai", "internal_error")
    request_id = response["x-request-id"]
    assert request_id.startswith("req_")
    assert error["message"] == f"Internal server error (request id {request_id})."
    assert "secret" not in response.content.decode()
    assert request_id in caplog.text


@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        pytest.param("/v1/models", "openai", id="openai"),
        pytest.param("/v1/messages", "anthropic", id="anthropic"),
    ],
)
async def test_a_host_that_is_not_allowed_is_a_json_400_under_v1(path, dialect):
    """API-4: Django refuses a Host header outside ALLOWED_HOSTS before any view, with its HTML
    400 page; under /v1/ the answer is the API's envelope."""
    response = await AsyncClient().get(path, headers={"host": "evil.example"})
    assert response["Content-Type"] == "application/json"
    assert_envelope(response, 400, dialect, "bad_request")
    page = await AsyncClient().get("/admin/", headers={"host": "evil.example"})
    assert page.status_code == 400 and "application/json" not in page["Content-Type"]


@pytest.mark.parametrize(("url", "dialect"), SURFACES)
@pytest.mark.parametrize("model", ["ti\x00ny", "t" * 65], ids=["nul", "over-64"])
async def test_a_model_name_no_alias_can_have_is_not_found_without_a_query(
    url, dialect, model, api_key, tiny_alias, monkeypatch
):
    """The fast full-lane check looks the model up before the body is validated: a name with a
    NUL (PostgreSQL refuses it in a text query: a 500 the OpenAPI fuzz found) or longer than an
    alias slug may be is "no such model" at once, never a query and never a cache entry."""
    from models_app.catalogue import hotcache, lookups

    def no_query(**_: object) -> None:
        raise AssertionError("an alias name that cannot exist reached the database")

    monkeypatch.setattr(lookups.selectors, "alias_resolve", no_query)
    with pytest.raises(lookups.ModelAlias.DoesNotExist):
        await lookups.alias_resolve(model)
    assert hotcache.aliases.get(model) is hotcache.MISS
    monkeypatch.undo()
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "input": "Hi"}
    body["max_tokens"] = 4
    response = await post_raw(url, json.dumps(body).encode(), api_key)
    assert response.status_code in (400, 404), response.content
    assert_envelope(response, response.status_code, dialect)
