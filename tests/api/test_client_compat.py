"""What real clients send and read, accepted (issue 13): routes, shapes and headers they rely on."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from tests.api.support import bearer, post_json, sse_payloads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("debug", [False, True])
async def test_an_unknown_v1_route_is_a_json_404_in_the_callers_envelope(settings, debug):
    """API-4: never Django's HTML page, with DEBUG on or off, for any method, before any auth."""
    settings.DEBUG = debug
    client = AsyncClient()
    openai = await client.post("/v1/nope/deeper", data="{}", content_type="application/json")
    assert openai.status_code == 404
    assert openai["Content-Type"] == "application/json"
    assert openai.json()["error"]["code"] == "unknown_route"
    anthropic = await client.get("/v1/files", headers=ANTHROPIC)
    assert anthropic.status_code == 404
    assert anthropic.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "Unknown route: GET /v1/files."},
    }
    page = await client.get("/not-the-api/")
    assert page.status_code == 404
    assert "application/json" not in page["Content-Type"]


@pytest.mark.parametrize("method", ["get", "post"])
async def test_a_bare_v1_is_a_json_404_not_a_redirect(method):
    """A new user's walk: `POST /v1` (a base URL posted to as it is) was APPEND_SLASH's empty 301."""
    response = await getattr(AsyncClient(), method)("/v1")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_route"


@pytest.mark.parametrize(("path", "method"), [("/v1/models", "post"), ("/v1/responses", "get")])
async def test_a_known_route_with_a_wrong_method_is_a_json_405(api_key, path, method):
    """API-4: the envelope, not an HTML page."""
    response = await getattr(AsyncClient(), method)(path, headers=bearer(api_key))
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


async def test_models_answer_in_anthropics_shape_for_an_anthropic_client(tiny_alias, api_key):
    """API-2, REG-8: with `anthropic-version` the list and one model read as Anthropic's."""
    headers = {"x-api-key": api_key, **ANTHROPIC}
    client = AsyncClient()
    page = (await client.get("/v1/models", headers=headers)).json()
    [model] = page["data"]
    assert set(model) == {"type", "id", "display_name", "created_at", "state"}  # state: REG-8
    assert (model["type"], model["id"], model["display_name"]) == ("model", "tiny", "tiny")
    assert model["created_at"].endswith("Z") and model["created_at"][:4].isdigit()
    assert (page["has_more"], page["first_id"], page["last_id"]) == (False, "tiny", "tiny")
    assert (await client.get("/v1/models/tiny", headers=headers)).json() == model
    missing = await client.get("/v1/models/nope", headers=headers)
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    openai = (await client.get("/v1/models", headers=bearer(api_key))).json()
    assert openai["object"] == "list" and openai["data"][0]["object"] == "model"


@pytest.mark.parametrize(
    ("thinking", "param"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, None),
        ({"type": "disabled"}, None),
        ({"type": "adaptive"}, None),
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 1023}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 4096}, "thinking"),  # not under max_tokens
    ],
)
def test_thinking_is_validated_as_anthropic_does(thinking, param):
    """API-2: extended thinking is accepted (a documented no-op for now); a bad one names its field."""
    from api.anthropic.serializers import MessagesInput
    from api.openai.serializers import first_error

    body = {"model": "tiny", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}
    serializer = MessagesInput(data={**body, "thinking": thinking})
    assert serializer.is_valid() is (param is None), serializer.errors
    if param is not None:
        assert first_error(serializer.errors)[0] == param


async def test_thinking_enabled_is_answered(tiny_alias, api_key, mlx_engine):
    """API-2: a thinking request gets an ordinary answer, and count_tokens takes it too."""
    headers = {"x-api-key": api_key, **ANTHROPIC}
    body = {
        "model": "tiny",
        "max_tokens": 1025,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    count = await post_json("/v1/messages/count_tokens", body, headers)
    assert count.status_code == 200, count.content
    answer = await post_json("/v1/messages", {**body, "stop_sequences": ["e", "a", "o", " "]}, headers)
    assert answer.status_code == 200, answer.content
    assert [block["type"] for block in answer.json()["content"]] == ["text"]


async def test_responses_accept_known_include_values(tiny_alias, api_key, mlx_engine):
    """API-1: `include` names only known values; each is accepted, an unknown one is a 400 naming it."""
    includes = ["message.output_text.logprobs", "reasoning.encrypted_content"]
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "store": False}
    ok = await post_json("/v1/responses", {**body, "include": includes}, bearer(api_key))
    assert ok.status_code == 200, ok.content
    bad = await post_json(
        "/v1/responses", {**body, "include": [includes[0], "output.everything"]}, bearer(api_key)
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "include[1]"


def test_the_validated_include_list_is_kept():
    from api.openai.responses_input import ResponsesInput

    for include, kept in ((None, []), (["web_search_call.results"], ["web_search_call.results"])):
        serializer = ResponsesInput(data={"model": "tiny", "input": "hi", "include": include})
        assert serializer.is_valid(), serializer.errors
        assert serializer.validated_data["include"] == kept


async def test_input_items_are_paged_newest_first_like_openai(tiny_alias, api_key, mlx_engine):
    """API-1: `order` (desc by default), `limit`, `after` / `before`, `has_more`; the assistant's
    own text is `output_text`."""
    turns = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    body = {"model": "tiny", "input": turns, "max_output_tokens": 1}
    created = (await post_json("/v1/responses", body, bearer(api_key))).json()
    url = f"/v1/responses/{created['id']}/input_items"

    async def page(query: str = "") -> dict:
        response = await AsyncClient().get(f"{url}{query}", headers=bearer(api_key))
        assert response.status_code == 200, response.content
        return response.json()

    def texts(listed: dict) -> list[str]:
        return [item["content"][0]["text"] for item in listed["data"]]

    newest = await page()
    assert texts(newest) == ["three", "two", "one"]
    assert [item["content"][0]["type"] for item in newest["data"]] == [
        "input_text",
        "output_text",
        "input_text",
    ]
    assert (newest["first_id"], newest["last_id"], newest["has_more"]) == (
        newest["data"][0]["id"],
        newest["data"][2]["id"],
        False,
    )
    first = await page("?limit=2")
    assert (texts(first), first["has_more"]) == (["three", "two"], True)
    rest = await page(f"?limit=2&after={first['last_id']}")
    assert (texts(rest), rest["has_more"]) == (["one"], False)
    assert texts(await page("?order=asc")) == ["one", "two", "three"]
    assert texts(await page(f"?order=asc&before={newest['first_id']}")) == ["one", "two"]
    for query, param in (
        ("?order=up", "order"),
        ("?limit=0", "limit"),
        ("?limit=101", "limit"),
        ("?after=msg_x", "after"),
    ):
        refused = await AsyncClient().get(f"{url}{query}", headers=bearer(api_key))
        assert refused.status_code == 400, query
        assert refused.json()["error"]["param"] == param


async def test_an_item_reference_to_a_stored_item_stands_for_its_turn(tiny_alias, api_key, mlx_engine):
    """API-1, PER-6: the Vercel AI SDK's turn 2 names the stored answer by its output item id;
    the turn it stands for is the answer's text (or an input item's turn), as if sent inline."""
    first = (
        await post_json(
            "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 3}, bearer(api_key)
        )
    ).json()
    answer = first["output"][0]
    text = answer["content"][0]["text"]
    inline = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "more"},
    ]
    by_reference = [
        {"type": "item_reference", "id": f"{first['id'].replace('resp_', 'msg_')}_0"},
        {"type": "item_reference", "id": answer["id"]},
        inline[2],
    ]
    body = {"model": "tiny", "max_output_tokens": 3, "store": True}
    expected = (
        await post_json("/v1/responses", {**body, "input": inline, "store": False}, bearer(api_key))
    ).json()
    second = await post_json("/v1/responses", {**body, "input": by_reference}, bearer(api_key))
    assert second.status_code == 200, second.content
    assert second.json()["output"][0]["content"][0]["text"] == expected["output"][0]["content"][0]["text"]
    assert second.json()["usage"]["input_tokens"] == expected["usage"]["input_tokens"]
    listed = await AsyncClient().get(
        f"/v1/responses/{second.json()['id']}/input_items?order=asc", headers=bearer(api_key)
    )
    assert [(i["role"], i["content"][0]["text"]) for i in listed.json()["data"]] == [
        (turn["role"], turn["content"]) for turn in inline
    ]


async def test_an_item_reference_to_a_missing_or_foreign_item_is_a_400_naming_it(
    tiny_alias, api_key, django_user_model, mlx_engine
):
    """API-4, PER-6: another tenant's item and a missing one answer alike: a 400 naming the input item."""
    from tests.support import user_with_key

    _, other_key = await sync_to_async(user_with_key)(django_user_model, "bob")
    theirs = (
        await post_json(
            "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1}, bearer(other_key)
        )
    ).json()
    for item_id in (theirs["output"][0]["id"], "msg_" + "0" * 32, "msg_0_7", "not-an-id"):
        body = {
            "model": "tiny",
            "input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": item_id}],
        }
        refused = await post_json("/v1/responses", body, bearer(api_key))
        assert refused.status_code == 400, refused.content
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("input[1]", "item_not_found")
        assert error["message"] == f"input[1]: no stored message or function_call item with id {item_id!r}."
    malformed = await post_json(
        "/v1/responses", {"model": "tiny", "input": [{"type": "item_reference"}]}, bearer(api_key)
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["param"] == "input"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_real_answer_cut_mid_character_never_ends_with_a_replacement(
    tiny_alias, tiny_model_dir, api_key, mlx_engine, stream
):
    """The tiny model forced to write the first byte of "é" (0xC3) and be cut there by max_tokens:
    the detokenizer's final flush decodes it as U+FFFD, which never reaches the client."""
    from tokenizers import Tokenizer

    lead_byte = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id("Ã")  # byte 0xC3
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    response = await post_json(
        "/v1/chat/completions",
        {**body, "logit_bias": {str(lead_byte): 100}, "stream": stream},
        bearer(api_key),
    )
    assert response.status_code == 200
    if stream:
        chunks = [c for c in await sse_payloads(response) if c != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert (text, finish) == ("", "length")


APP = "http://app.example:5173"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
}


def cors_headers(response) -> dict[str, str]:
    return {
        name.lower(): value for name, value in response.items() if name.lower().startswith("access-control-")
    }


async def test_without_allowed_origins_a_preflight_gets_no_cors(settings):
    """The default (MLXHOST_CORS_ORIGINS empty): no browser origin may call the API."""
    settings.MLXHOST_CORS_ORIGINS = []
    response = await AsyncClient().options("/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 405
    assert cors_headers(response) == {}


async def test_a_preflight_from_an_allowed_origin_is_answered(settings):
    settings.MLXHOST_CORS_ORIGINS = ["http://other.example", APP]
    client = AsyncClient()
    response = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 204
    headers = cors_headers(response)
    assert headers["access-control-allow-origin"] == APP
    assert "POST" in headers["access-control-allow-methods"]
    allowed = {h.strip() for h in headers["access-control-allow-headers"].split(",")}
    assert {
        "authorization",
        "content-type",
        "x-api-key",
        "anthropic-version",
        "anthropic-beta",
        "openai-beta",
    } <= allowed
    assert "x-stainless-os" in allowed
    assert int(headers["access-control-max-age"]) > 0
    assert "Origin" in response["Vary"]
    foreign = await client.options(
        "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"}
    )
    assert foreign.status_code == 405
    assert cors_headers(foreign) == {}
    outside = await client.options("/admin/", headers=PREFLIGHT)
    assert cors_headers(outside) == {}


async def test_responses_to_an_allowed_origin_are_marked_streaming_ones_too(
    settings, tiny_alias, api_key, mlx_engine
):
    settings.MLXHOST_CORS_ORIGINS = [APP]
    headers = {**bearer(api_key), "Origin": APP}
    listed = await AsyncClient().get("/v1/models", headers=headers)
    assert listed["Access-Control-Allow-Origin"] == APP
    assert "Origin" in listed["Vary"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    streamed = await post_json("/v1/chat/completions", body, headers)
    assert streamed["Access-Control-Allow-Origin"] == APP
    exposed = {h.strip() for h in streamed["Access-Control-Expose-Headers"].split(",")}
    assert {"X-Request-Id", "X-Session-Cache"} <= exposed
    assert (await sse_payloads(streamed))[-1] == "[DONE]"
    refused = await AsyncClient().get("/v1/models", headers={"Origin": APP})  # no key: 401, still readable
    assert (refused.status_code, refused["Access-Control-Allow-Origin"]) == (401, APP)
    settings.MLXHOST_CORS_ORIGINS = ["*"]
    anyone = await AsyncClient().get("/v1/models", headers={**bearer(api_key), "Origin": "http://x.example"})
    assert anyone["Access-Control-Allow-Origin"] == "*"


async def test_an_anthropic_prefill_is_continued_not_repeated(
    tiny_alias, tiny_model_dir, api_key, mlx_engine
):
    """API-2: a conversation ending in an assistant message is a prefill. The template renders it
    open, with no generation prompt after it: the prompt is the unprefilled one plus exactly the
    prefill's tokens (a closed turn would add its end marker and a new assistant header)."""
    from tokenizers import Tokenizer

    headers = {"x-api-key": api_key, **ANTHROPIC}
    asked = [{"role": "user", "content": "Tell me a story"}]
    prefill = "Once upon a time"
    prefilled = [*asked, {"role": "assistant", "content": prefill}]

    async def count(messages: list[dict]) -> int:
        counted = await post_json(
            "/v1/messages/count_tokens", {"model": "tiny", "messages": messages}, headers
        )
        assert counted.status_code == 200, counted.content
        return counted.json()["input_tokens"]

    prefill_tokens = len(Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(prefill).ids)
    assert await count(prefilled) == await count(asked) + prefill_tokens
    answer = await post_json(
        "/v1/messages", {"model": "tiny", "messages": prefilled, "max_tokens": 4}, headers
    )
    assert answer.status_code == 200, answer.content
    usage = answer.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == await count(prefilled)
    assert (answer.json()["stop_reason"], usage["output_tokens"]) == ("max_tokens", 4)
