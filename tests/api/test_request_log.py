"""Request ids and the one log line per API request (OPS-6), over HTTP and the WebSocket."""

from __future__ import annotations

import json
import logging
import re

import pytest
from django.test import AsyncClient

from mlxhost.request_log import line_of, sane_id
from tests.api.support import (
    HELLO,
    WS_TERMINAL,
    StreamReader,
    bearer,
    connect,
    every_auth,
    frames_until,
    key_headers,
    post_json,
    ws_create,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

LOGGER = "mlxhost.requests"
PROMPT = "the secret plan is pineapple-7731"
MINTED = re.compile(r"req_[0-9a-f]{24}")
TURN_FIELDS = ("alias", "model", "instance", "queue_ms", "first_token_ms", "prompt_tokens",
               "completion_tokens", "cached_tokens", "cache")  # fmt: skip


def lines(caplog) -> list[dict]:
    """The fields of each request line logged so far."""
    return [record.request_fields for record in caplog.records if record.name == LOGGER]


def chat(stream: bool = False, **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "stream": stream, **fields}  # fmt: skip


@pytest.fixture
def logged(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    return caplog


RESPONSE = {"model": "tiny", "input": "a", "max_output_tokens": 2, "store": False}
ROUTES = [
    pytest.param("get", "/v1/models", None, 200, id="models"),
    pytest.param("post", "/v1/chat/completions", chat(), 200, id="chat"),
    pytest.param("post", "/v1/chat/completions", chat(stream=True), 200, id="chat-stream"),
    pytest.param(
        "post", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}, 200, id="text"
    ),
    pytest.param("post", "/v1/responses", RESPONSE, 200, id="responses"),
    pytest.param(
        "post", "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": HELLO}, 200, id="messages"
    ),
    pytest.param("post", "/v1/chat/completions", {"model": "tiny"}, 400, id="bad-body"),
    pytest.param("post", "/v1/chat/completions", chat(model="nope"), 404, id="unknown-model"),
    pytest.param("get", "/v1/no/such/route", None, 404, id="unknown-route"),
    pytest.param("get", "/healthz", None, 200, id="healthz"),
    pytest.param("get", "/readyz", None, 200, id="readyz"),
    pytest.param("get", "/metrics", None, 200, id="metrics"),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), ROUTES)
async def test_every_api_response_carries_its_request_id_and_leaves_one_line(
    tiny_alias, api_key, mlx_engine, logged, method, path, body, status
):
    """OPS-6: each API answer, refusals and probes included, has an `x-request-id`, and the
    request leaves exactly one log line under that id (a stream's when it ends)."""
    client = AsyncClient()
    if body is None:
        response = await getattr(client, method)(path, headers=every_auth(api_key))
    else:
        response = await post_json(path, body, every_auth(api_key))
    assert response.status_code == status, response.content
    if response.streaming:
        assert lines(logged) == []  # not before the stream has ended
        content = b"".join([chunk async for chunk in response.streaming_content])
    else:
        content = response.content
    request_id = response["x-request-id"]
    [line] = lines(logged)
    assert (line["id"], line["method"], line["path"], line["status"]) == (
        request_id,
        method.upper(),
        path,
        status,
    )
    if status == 200 and path.startswith("/v1/") and method == "post":
        # A turn: known by its response id, as the answer's own `id` (or the stream's) says.
        assert request_id.startswith(("chatcmpl-", "cmpl-", "resp_", "msg_"))
        assert f'"id":"{request_id}"'.encode() in content.replace(b'"id": "', b'"id":"')
    else:
        assert MINTED.fullmatch(request_id)
        assert line["outcome"] == ("ok" if status == 200 else "error")


async def test_the_line_of_a_turn_has_its_fields_and_no_secrets(tiny_alias, api_key, mlx_engine, logged):
    """OPS-6, API-4: the line says alias, model, instance, outcome, queue and first-token times,
    tokens and the cache outcome; never the key, the prompt or the answer."""
    first = await post_json("/v1/chat/completions", chat(), bearer(api_key))
    again = await post_json("/v1/chat/completions", chat(), bearer(api_key))
    answer = first.json()["choices"][0]["message"]["content"]
    fresh, warm = lines(logged)
    for line, response in ((fresh, first), (warm, again)):
        assert set(TURN_FIELDS) <= line.keys()
        assert (line["alias"], line["model"], line["instance"]) == ("tiny", "tiny", tiny_alias.instance_id)
        assert line["outcome"] == response.json()["choices"][0]["finish_reason"] == "length"
        assert line["completion_tokens"] == 4 and line["prompt_tokens"] > 0
        assert line["queue_ms"] >= 0 and line["first_token_ms"] > 0 and line["duration_ms"] > 0
        assert line["cache"] == response["X-Session-Cache"]
    assert (fresh["cache"], warm["cache"]) == ("fresh", "hit") and warm["cached_tokens"] > 0
    text = logged.text + "".join(json.dumps(line) for line in lines(logged))
    assert api_key not in text and api_key[:20] not in text
    assert "pineapple" not in text and (not answer.strip() or answer not in text)


async def test_a_client_request_id_is_honoured_when_sane(tiny_alias, api_key, mlx_engine, logged):
    """OPS-6: a sane `x-request-id` names the request (header and line, a turn's too); anything
    else is replaced by a minted id, so a header can never forge or break a log line."""
    given = {**bearer(api_key), "x-request-id": "gw-7f3a:01.b_c"}
    response = await post_json("/v1/chat/completions", chat(), given)
    assert response["x-request-id"] == "gw-7f3a:01.b_c"
    assert response.json()["id"].startswith("chatcmpl-")  # the response keeps its own id
    for odd in ("two words", 'quote"d', "x" * 129, "new\\nline", "caf\u00e9", ""):
        refused = await AsyncClient().get("/v1/models", headers={**bearer(api_key), "x-request-id": odd})
        assert MINTED.fullmatch(refused["x-request-id"]), odd
    assert lines(logged)[0]["id"] == "gw-7f3a:01.b_c"
    assert sane_id("a" * 128) and not sane_id("a" * 129)


async def test_refusals_say_their_error_code(tiny_alias, mlx_engine, logged):
    """OPS-6: a refused request's line carries its status and error code."""
    response = await post_json("/v1/chat/completions", chat(), bearer("mlxh_not_a_key_at_all"))
    assert response.status_code == 401
    [line] = lines(logged)
    assert (line["status"], line["outcome"], line["error"]) == (401, "error", "invalid_api_key")


async def test_a_stream_the_client_leaves_logs_as_cancelled(
    tiny_alias, api_key, mlx_engine, logged, tiny_eos_id
):
    """OPS-6, LANE-6: a client that hangs up mid-stream still leaves its line, saying so."""
    body = chat(stream=True, max_tokens=100_000, logit_bias={str(tiny_eos_id): -100})
    response = await post_json("/v1/chat/completions", body, bearer(api_key))
    reader = StreamReader(response)
    await reader.wait_for(2)  # the stream is under way
    await reader.hang_up()
    [line] = lines(logged)
    assert line["outcome"] == "cancelled" and line["id"] == response["x-request-id"]


async def test_a_server_error_names_the_request_id_everywhere(
    tiny_alias, api_key, mlx_engine, logged, monkeypatch
):
    """OPS-6, API-4: a 500 carries the request's id (a client's own one too) in its header, its
    message and the log line."""

    def explode(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr("api.openai.views.validated", explode)
    response = await post_json(
        "/v1/chat/completions", chat(), {**bearer(api_key), "x-request-id": "trace-42"}
    )
    assert response.status_code == 500
    assert response["x-request-id"] == "trace-42"
    assert "(request id trace-42)" in response.json()["error"]["message"]
    [line] = lines(logged)
    assert (line["id"], line["status"], line["error"]) == ("trace-42", 500, "internal_error")


async def test_a_websocket_turn_leaves_a_line_too(tiny_alias, api_key, mlx_engine, logged):
    """OPS-6: each WebSocket turn leaves the same line, with method WS and its response id."""
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input=PROMPT, max_output_tokens=3, store=False)
    frames = await frames_until(socket, *WS_TERMINAL)
    await socket.disconnect()
    [line] = lines(logged)
    assert (line["method"], line["path"], line["alias"]) == ("WS", "/ws/v1/responses", "tiny")
    assert line["id"] == frames[-1]["response"]["id"] and line["outcome"] == "length"
    assert "pineapple" not in logged.text


def test_values_with_odd_characters_are_quoted():
    """OPS-6: a value that could break the line (a space, a newline, a quote) is JSON-quoted."""
    assert line_of({"a": "plain-1.2", "b": "two words", "c": 'x"\ny', "d": None}) == (
        'a=plain-1.2 b="two words" c="x\\"\\ny" d=-'
    )


async def test_health_probes_log_at_debug(mlx_engine, caplog):
    """OPS-6: probes do not flood the log: their lines are DEBUG, API requests' INFO."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert (await AsyncClient().get("/healthz"))["x-request-id"]
    assert lines(caplog) == []


async def test_a_runs_captured_logs_hold_no_key_and_no_prompt_text(tiny_alias, api_key, mlx_engine, caplog):
    """OPS-6, API-4: every record of a run at the production level (INFO, all loggers), across
    surfaces, a stored turn, a stream, a refusal and a bad key, holds neither key material nor
    the prompt's text."""
    caplog.set_level(logging.INFO)
    secret = "zanzibar-marmalade-42"
    said = [{"role": "user", "content": f"Please remember {secret}."}]
    anthropic = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    calls = [
        ("/v1/chat/completions", {"model": "tiny", "messages": said, "max_tokens": 3}, bearer(api_key)),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": said, "max_tokens": 3, "stream": True},
            bearer(api_key),
        ),
        (
            "/v1/responses",
            {"model": "tiny", "input": f"Remember {secret}", "max_output_tokens": 3},
            bearer(api_key),
        ),
        ("/v1/messages", {"model": "tiny", "messages": said, "max_tokens": 3}, anthropic),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": said, "temperature": 9},
            bearer(api_key),
        ),  # 400
        ("/v1/chat/completions", {"model": "tiny", "messages": said}, bearer(api_key[:-4] + "abcd")),  # 401
    ]
    statuses = []
    for path, body, headers in calls:
        response = await post_json(path, body, headers)
        if response.streaming:  # read to its end, as a client does: the line comes then
            _ = [chunk async for chunk in response.streaming_content]
        statuses.append(response.status_code)
    assert statuses == [200, 200, 200, 200, 400, 401]
    records = caplog.records
    assert len([r for r in records if r.name == "mlxhost.requests"]) >= 6
    text = "\n".join(
        f"{r.name} {r.getMessage()} {json.dumps(getattr(r, 'request_fields', {}))}" for r in records
    )
    for needle in (api_key, api_key[:-4] + "abcd", api_key[5:21], secret):
        assert needle not in text, needle


async def test_a_minted_request_id_makes_no_system_call(api_key, monkeypatch):
    """Issue 25 §4: request ids are not secrets; minting one never calls os.urandom, which lets
    go of the GIL (a loop waiting to take it back behind a generating worker lost ~1 ms a request)."""
    import os
    import random

    from mlxhost import request_log

    def refused(size: int) -> bytes:
        raise AssertionError("os.urandom called")

    # Undone before the test ends: fixtures' teardown (the database, the engine) may draw
    # random bytes, which is no request id's doing.
    with monkeypatch.context() as patched:
        patched.setattr(os, "urandom", refused)
        patched.setattr(random, "_urandom", refused)  # what `secrets` reaches it through
        ids = {request_log.current_request_id() for _ in range(1000)}
        response = await AsyncClient().get("/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    assert len(ids) == 1000 and all(MINTED.fullmatch(i) for i in ids)
    assert response.status_code == 200 and MINTED.fullmatch(response["x-request-id"])
