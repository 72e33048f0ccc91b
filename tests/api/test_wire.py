"""Issue 25: every JSON the server writes is strict JSON (no NaN, no Infinity), on HTTP, SSE and the
WebSocket; an answer holding such a value ends in a clean error in the surface's envelope."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from api.openai.views import sse_response
from api.sse import sse_event
from mlxhost import wire
from tests.api.support import bearer, connect, frames_until, key_headers, post_json, ws_create

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

NOT_FINITE = [pytest.param(float("-inf"), id="-Infinity"), pytest.param(float("nan"), id="NaN")]


def strict(text: str | bytes):
    """`text` parsed as JSON.parse, serde or Go would: NaN and Infinity are not JSON."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("value", NOT_FINITE)
def test_the_writer_refuses_what_json_cannot_carry(value):
    for write in (wire.dumps, wire.json_response, sse_event):
        with pytest.raises(wire.NotJSONError):
            write({"logprob": value})
    assert strict(wire.dumps({"a": 0.5, "b": "é"})) == {"a": 0.5, "b": "é"}
    assert wire.dumps({"a": [1, 2]}) == '{"a":[1,2]}'  # compact, as the streams have been


@pytest.fixture
def poisoned(monkeypatch):
    """`poison(value)`: every alternative logprob the real tiny model reports becomes `value`
    (what a grammar's mask gave: -Infinity in 19 of 20 top_logprobs slots)."""
    from mlxhost.engine.backends.mlx.grammar import Vocabulary

    real = Vocabulary.logprob

    def poison(value: float) -> None:
        def logprob(self, logprobs, token, top):
            entry = real(self, logprobs, token, top)
            return dataclasses.replace(
                entry, top=tuple(dataclasses.replace(t, logprob=value) for t in entry.top)
            )

        monkeypatch.setattr(Vocabulary, "logprob", logprob)

    return poison


HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": HI, "logprobs": True, "top_logprobs": 3, "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "1, 2, 3,", "logprobs": 3, "max_tokens": 4}
RESPONSES = {
    "model": "tiny",
    "input": "hi",
    "top_logprobs": 3,
    "include": ["message.output_text.logprobs"],
    "max_output_tokens": 4,
    "store": False,
}
SURFACES = [
    pytest.param("/v1/chat/completions", CHAT, id="chat"),
    pytest.param("/v1/completions", COMPLETION, id="completions"),
    pytest.param("/v1/responses", RESPONSES, id="responses"),
]


def sse_frames(raw: bytes) -> list[tuple[str | None, str]]:
    frames = []
    for block in raw.decode().strip().split("\n\n"):
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if not lines:
            continue
        event = next((line[len("event: ") :] for line in lines if line.startswith("event: ")), None)
        data = "\n".join(line[len("data: ") :] for line in lines if line.startswith("data: "))
        frames.append((event, data))
    return frames


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize(("path", "body"), SURFACES)
async def test_an_unwritable_answer_is_a_clean_500(
    tiny_alias, api_key, mlx_engine, poisoned, path, body, value
):
    """HTTP: a 500 in the OpenAI envelope, strict JSON, never a 200 body JSON.parse rejects."""
    poisoned(value)
    response = await post_json(path, body, bearer(api_key))
    assert response.status_code == 500, response.content
    error = strict(response.content)["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize(("path", "body"), SURFACES)
async def test_an_unwritable_stream_ends_with_a_clean_error_event(
    tiny_alias, api_key, mlx_engine, poisoned, path, body, value
):
    """SSE: every frame is strict JSON; the stream ends with the surface's error event."""
    poisoned(value)
    response = await post_json(path, {**body, "stream": True}, bearer(api_key))
    assert response.status_code == 200
    frames = sse_frames(b"".join([chunk async for chunk in response.streaming_content]))
    payloads = [strict(data) for _, data in frames if data != "[DONE]"]
    if path == "/v1/responses":
        assert frames[-1][0] == "error"
        assert (payloads[-1]["type"], payloads[-1]["code"]) == ("error", "internal_error")
        assert not any(p["type"] == "response.completed" for p in payloads)
    else:
        assert frames[-1][1] == "[DONE]"
        assert payloads[-1]["error"]["code"] == "internal_error"
        # Cut short, so never a chunk that reads like a finished answer.
        assert not any(c["finish_reason"] for p in payloads[:-1] for c in p["choices"])


@pytest.mark.parametrize("value", NOT_FINITE)
async def test_an_unwritable_socket_turn_ends_with_an_error_frame(
    tiny_alias, api_key, mlx_engine, poisoned, value
):
    """WebSocket: the turn's error frame (with its response id), and the socket stays usable."""
    poisoned(value)
    socket = await connect(key_headers(api_key))
    await ws_create(socket, **RESPONSES)
    frames = await frames_until(socket, "error", "response.completed", "response.incomplete")
    error = frames[-1]
    assert error["type"] == "error" and error["error"]["code"] == "internal_error"
    assert error["response_id"] == frames[0]["response"]["id"]
    await ws_create(socket, input="hi", max_output_tokens=2, store=False)  # no logprobs: writable
    after = await frames_until(socket, "error", "response.completed", "response.incomplete")
    assert after[-1]["type"] in ("response.completed", "response.incomplete")
    await socket.disconnect()


@pytest.mark.parametrize(
    ("surface", "event", "kind"),
    [("chat", None, "server_error"), ("anthropic", "error", "api_error"), ("responses", "error", "error")],
)
async def test_every_sse_surface_ends_an_unwritable_stream_in_its_shape(surface, event, kind):
    """The guard `sse_response` puts on every stream (Anthropic Messages has no floats to poison)."""

    async def frames():
        yield sse_event({"type": "ping"})
        yield sse_event({"logprob": math.nan})

    response = sse_response(frames(), {}, surface=surface)
    raw = b"".join([chunk async for chunk in response.streaming_content])
    got = sse_frames(raw)
    assert got[0] == (None, '{"type":"ping"}')
    if surface == "chat":
        assert got.pop() == (None, "[DONE]")
    [(error_event, data)] = got[1:]
    body = strict(data)
    assert error_event == event
    assert (body["error"]["type"] if "error" in body else body["type"]) == kind
