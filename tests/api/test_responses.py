"""POST /v1/responses and friends through Django with the tiny real MLX model: chains, swaps, tenants."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from tests.api.support import StreamReader
from tests.support import register_alias, user_with_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

URL = "/v1/responses"


class Caller:
    """One tenant's HTTP client for the Responses surface."""

    def __init__(self, key: str, owner_id: int) -> None:
        self.owner_id = owner_id
        self.headers = {"Authorization": f"Bearer {key}"}
        self.client = AsyncClient()

    async def create(self, **body):
        body = {"model": "tiny", **body}
        return await self.client.post(
            URL, data=json.dumps(body), content_type="application/json", headers=self.headers
        )

    async def ok(self, **body) -> dict:
        response = await self.create(**body)
        assert response.status_code == 200, response.content
        return response.json()

    async def clean(self, **body) -> dict:
        """A stored turn that ends cleanly ("completed"), so its KV cache becomes a warm session.

        The tiny model rarely says EOS; a probe finds its greedy text and a stop string cuts it.
        """
        probe = await self.ok(**body, store=False, max_output_tokens=8, cache_salt="probe")
        if probe["status"] == "completed":
            return await self.ok(**body, max_output_tokens=8)
        text = probe["output"][0]["content"][0]["text"]
        turn = await self.ok(**body, max_output_tokens=8, stop=[text[len(text) // 2]])
        assert turn["status"] == "completed"
        return turn

    async def call(self, method: str, path: str):
        return await getattr(self.client, method)(path, headers=self.headers)


def tiny_alias_owner(caller: Caller) -> int:
    return caller.owner_id


def text_of(body: dict) -> str:
    return body["output"][0]["content"][0]["text"]


def cached(body: dict) -> int:
    return body["usage"]["input_tokens_details"]["cached_tokens"]


@pytest.fixture
def alice(api_key, user) -> Caller:
    return Caller(api_key, user.pk)


@pytest.fixture
def bob(django_user_model) -> Caller:
    user, raw = user_with_key(django_user_model, "bob")
    return Caller(raw, user.pk)


async def test_a_response_has_the_openai_shape_and_is_stored(tiny_alias, alice, mlx_engine):
    """API-1, PER-1: the response object, its usage, and the stored row it leaves behind."""
    body = await alice.ok(input="hello there", max_output_tokens=5, metadata={"run": "1"})
    assert body["object"] == "response"
    assert body["id"].startswith("resp_")
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 5
    assert body["output"][0]["role"] == "assistant"
    stored = (await alice.call("get", f"{URL}/{body['id']}")).json()
    assert stored["output"] == body["output"]
    assert stored["usage"] == body["usage"]
    assert stored["metadata"] == {"run": "1"}
    items = (await alice.call("get", f"{URL}/{body['id']}/input_items")).json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["hello there"]


async def test_streaming_sends_the_responses_event_sequence(tiny_alias, alice, mlx_engine):
    """API-1: created, in_progress, item/part added, deltas, done events, then the terminal event."""
    response = await alice.create(input="hi", max_output_tokens=4, stream=True)
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") >= 1
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == deltas


async def test_turn_three_is_warm_and_a_cold_replay_matches_it(tiny_alias, alice, mlx_engine):
    """SES-2, SES-7, SES-1: a warm chain hits; after eviction the same turn replays cold, same output."""
    first = await alice.clean(input="hello there", instructions="Be brief.")
    second = await alice.clean(input="tell me more", previous_response_id=first["id"])
    assert second["instructions"] == "Be brief."  # inherited from the chain
    third = await alice.create(input="and then?", previous_response_id=second["id"], max_output_tokens=10)
    assert third["X-Session-Cache"] == "hit"
    assert cached(third.json()) > 0

    for instance in mlx_engine.registry.instances():
        instance.sessions.clear()  # evict every warm session
    replay = await alice.create(input="and then?", previous_response_id=second["id"], max_output_tokens=10)
    assert replay["X-Session-Cache"] == "cold_replay"
    assert cached(replay.json()) == 0
    assert text_of(replay.json()) == text_of(third.json())


async def test_a_hot_swapped_alias_refuses_the_chain_and_an_alias_of_the_same_weights_continues(
    tiny_alias, tiny_model_b_dir, alice, mlx_engine
):
    """REG-4: continuing on other weights is a 400; another alias of the same weights may continue."""
    from models_app.catalogue import reconcile as control

    first = await alice.ok(input="hello", max_output_tokens=3)
    await sync_to_async(register_alias)(name="twin", folder="tiny-llama")
    twin = await alice.create(
        model="twin", input="more", previous_response_id=first["id"], max_output_tokens=3
    )
    assert twin.status_code == 200

    await sync_to_async(register_alias)(name="tiny", folder="tiny-llama-b")
    await control.reconcile(mlx_engine, load_pinned=False)  # the control listener, on commit
    swapped = await alice.create(input="more", previous_response_id=first["id"], max_output_tokens=3)
    assert swapped.status_code == 400
    assert swapped.json()["error"]["code"] == "model_changed"
    assert swapped.json()["error"]["param"] == "previous_response_id"


async def test_a_chain_from_an_earlier_boot_is_checked_by_weights_fingerprint(tiny_alias, alice, mlx_engine):
    """REG-4: another boot's instance ids are not live; the fingerprint decides."""
    from models_app.models import StoredResponse
    from models_app.persistence.persistence import persistence

    first = await alice.ok(input="hello", max_output_tokens=3)
    await persistence().fetch(public_id=first["id"], owner_id=tiny_alias_owner(alice))  # landed
    await StoredResponse.objects.filter(public_id=first["id"]).aupdate(
        boot_id="earlier-boot", instance_id=999
    )
    same = await alice.create(input="more", previous_response_id=first["id"], max_output_tokens=3)
    assert same.status_code == 200
    await StoredResponse.objects.filter(public_id=first["id"]).aupdate(weights_fingerprint="0" * 64)
    other = await alice.create(input="more", previous_response_id=first["id"], max_output_tokens=3)
    assert other.status_code == 400


async def test_another_tenants_response_is_a_404_identical_to_a_missing_one(
    tiny_alias, alice, bob, mlx_engine
):
    """PER-6: 100 attempts to read, continue, cancel or delete another tenant's response all 404."""
    owned = (await alice.ok(input="secret plans", max_output_tokens=3))["id"]
    missing = "resp_" + "0" * 32
    attempts = [
        ("get", f"{URL}/{{id}}"),
        ("get", f"{URL}/{{id}}/input_items"),
        ("post", f"{URL}/{{id}}/cancel"),
        ("delete", f"{URL}/{{id}}"),
    ]
    for round_ in range(25):
        for method, path in attempts:
            theirs = await bob.call(method, path.format(id=owned))
            nothing = await bob.call(method, path.format(id=missing))
            assert theirs.status_code == nothing.status_code == 404
            assert theirs.content == nothing.content
        continued = await bob.create(input="x", previous_response_id=owned, max_output_tokens=2)
        assert continued.status_code == 404, round_
    assert (await alice.call("get", f"{URL}/{owned}")).status_code == 200


async def test_another_tenant_never_reuses_my_prefix_but_reuses_its_own(tiny_alias, alice, bob, mlx_engine):
    """SES-3, SES-8 (paired): the same prompt is cached per tenant, never across tenants."""
    prompt = "a shared long prompt about the weather in Paris and Lyon"
    await alice.clean(input=prompt)
    bobs_first = await bob.clean(input=prompt)
    assert cached(bobs_first) == 0
    bobs_second = await bob.create(input=prompt, max_output_tokens=3)
    assert cached(bobs_second.json()) > 0
    assert bobs_second["X-Session-Cache"] == "hit"


async def test_delete_removes_the_response(tiny_alias, alice, mlx_engine):
    """API-1: DELETE answers response.deleted; the id is then gone."""
    body = await alice.ok(input="hello", max_output_tokens=2)
    deleted = await alice.call("delete", f"{URL}/{body['id']}")
    assert deleted.json() == {"id": body["id"], "object": "response.deleted", "deleted": True}
    assert (await alice.call("get", f"{URL}/{body['id']}")).status_code == 404


async def test_bad_input_is_a_400_with_param(tiny_alias, alice, mlx_engine):
    """API-4: validation errors name the parameter; unsupported features say so."""
    cases = [
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "store": "yes"}, "store"),
    ]
    for body, param in cases:
        response = await alice.create(**body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param
    missing = await alice.create(input="hi", previous_response_id="resp_nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"


async def test_cancel_stops_a_running_response_and_it_is_stored_as_cancelled(
    tiny_alias, alice, bob, mlx_engine, tiny_eos_id
):
    """LANE-6, PER-1: POST .../cancel ends a running stream; the row keeps its true status."""
    from models_app.persistence.persistence import persistence

    response = await alice.create(
        input="go on forever", stream=True, max_output_tokens=100_000, logit_bias={str(tiny_eos_id): -100}
    )
    response_id = response["X-Request-Id"]
    chunks = response.streaming_content.__aiter__()
    await anext(chunks)
    assert (await bob.call("post", f"{URL}/{response_id}/cancel")).status_code == 404  # not bob's
    cancelled = await alice.call("post", f"{URL}/{response_id}/cancel")
    assert cancelled.json()["status"] == "cancelled"
    rest = b"".join([chunk async for chunk in chunks]).decode()
    last = json.loads([line for line in rest.splitlines() if line.startswith("data: ")][-1][6:])
    assert last["response"]["status"] == "cancelled"
    row = await persistence().fetch(public_id=response_id, owner_id=alice.owner_id)
    assert row.status == "cancelled"
    assert row.output_text == last["response"]["output"][0]["content"][0]["text"]
    # Kept up to the tokens it produced (SES-1, issue 12), though a cancelled response cannot be continued.
    assert mlx_engine.snapshot()[0]["prefix_cache"]["memory"]["entries"] == 1


async def test_a_hung_up_stream_is_stored_as_cancelled_without_claimed_usage(
    tiny_alias, alice, mlx_engine, tiny_eos_id
):
    """PER-1, SES-1: a client that hangs up leaves a cancelled row and no warm session."""
    from models_app.persistence.persistence import persistence

    response = await alice.create(
        input="talk", stream=True, max_output_tokens=100_000, logit_bias={str(tiny_eos_id): -100}
    )

    reader = StreamReader(response)
    await reader.wait_for(3)  # the stream is under way
    await reader.hang_up()
    row = await persistence().fetch(public_id=response["X-Request-Id"], owner_id=alice.owner_id)
    assert row.status == "cancelled"
    assert row.usage == {}


async def test_a_turn_cancelled_inside_prepare_leaks_no_retention_and_no_live_entry(
    tiny_alias, user, mlx_engine, settings, monkeypatch
):
    """REG-6, OPS-9 (issue 25): with Redis configured, a Responses turn whose caller goes away
    while `ResponseHooks.prepare` shares its live entry gives back the instance's retention, the
    lane permit, this host's live entry and the shared one."""
    import asyncio

    from api.openai.responses_input import ResponsesInput, response_request
    from api.openai.views import validated
    from models_app.turns import live_responses
    from models_app.turns.response_turns import response_start

    settings.REDIS_URL = "redis://127.0.0.1:6379/6"  # shared: `started` awaits the cache
    entered, written, deleted = asyncio.Event(), [], []

    async def slow_set(key, value, timeout=None):
        written.append(key)
        entered.set()
        await asyncio.Event().wait()  # Redis is slow: the caller gives up meanwhile

    async def delete(key):
        deleted.append(key)

    monkeypatch.setattr(live_responses.cache, "aset", slow_set)
    monkeypatch.setattr(live_responses.cache, "adelete", delete)
    data = validated(ResponsesInput, {"model": "tiny", "input": "hi", "max_output_tokens": 2})
    data["stream"] = True
    task = asyncio.create_task(
        response_start(response_request(data), user.pk, response_id="resp_prepare_cancel")
    )
    await asyncio.wait_for(entered.wait(), 30)
    (instance,) = mlx_engine.registry.instances()
    assert mlx_engine.registry.holds(instance).retentions == 1  # taken inside prepare
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the shared entry's removal runs as a task of its own
    while live_responses._clearing:
        await asyncio.gather(*live_responses._clearing)
    assert mlx_engine.registry.holds(instance).retentions == 0
    assert live_responses.local_owner("resp_prepare_cancel") is None
    assert deleted == written == ["live-response:resp_prepare_cancel"]
    lane = mlx_engine.snapshot()[0]["lane"]
    assert (lane["active"], lane["queued"], lane["permits"]) == (0, 0, 0)
