"""`metadata` within OpenAI's bounds: at most 16 pairs, keys of at most 64 characters, string
values of at most 512, on every surface that takes it (issue 25)."""

from __future__ import annotations

import pytest

from tests.api.support import bearer, connect, frames_until, key_headers, post_json, ws_create

pytestmark = [pytest.mark.django_db(transaction=True)]

LARGEST = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}
OVER = [
    pytest.param({f"k{i}": "v" for i in range(17)}, "metadata", id="17-pairs"),
    pytest.param({"k" * 65: "v"}, "metadata", id="key-of-65"),
    pytest.param({"k" * 200_000: "v"}, "metadata", id="key-of-200k"),
    pytest.param({"k": "v" * 513}, "metadata.k", id="value-of-513"),
    pytest.param({"k": 5}, "metadata.k", id="value-not-a-string"),
    pytest.param({"k": {"nested": "v"}}, "metadata.k", id="value-an-object"),
    pytest.param(["k", "v"], "metadata", id="not-an-object"),
]
SURFACES = [
    pytest.param("/v1/responses", {"input": "hi", "max_output_tokens": 1, "store": False}, id="responses"),
    pytest.param(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, id="chat"
    ),
]


@pytest.mark.parametrize(("path", "body"), SURFACES)
@pytest.mark.parametrize(("metadata", "param"), OVER)
async def test_metadata_over_openais_bounds_is_a_400_naming_it(path, body, metadata, param, api_key):
    """Refused before any work (no model is even looked up), with a short `param`."""
    response = await post_json(
        path, {"model": "no-such-model", **body, "metadata": metadata}, bearer(api_key)
    )
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert len(error["message"]) < 200


@pytest.mark.parametrize(("metadata", "param"), OVER)
async def test_metadata_over_the_bounds_is_an_error_frame_on_the_websocket(metadata, param, api_key):
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input="hi", store=False, metadata=metadata)
    [frame] = await frames_until(socket, "error")
    assert (frame["status"], frame["error"]["param"]) == (400, param)
    await socket.disconnect()


async def test_metadata_at_the_bounds_is_stored_and_echoed(tiny_alias, api_key, mlx_engine):
    """16 pairs of 64-character keys and 512-character values: the most a response may carry."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1, "metadata": LARGEST}
    response = await post_json("/v1/responses", body, bearer(api_key))
    assert response.status_code == 200, response.content[:300]
    assert response.json()["metadata"] == LARGEST
