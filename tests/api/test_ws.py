"""WebSocket /ws/v1/responses in process (channels' WebsocketCommunicator) with the tiny real MLX model."""

from __future__ import annotations

import asyncio
import json
from typing import get_args

import pytest
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient

from mlxhost.asgi import application
from mlxhost.engine.sessions import Outcome
from tests.api.support import WS_HOST, WS_PATH, WS_TERMINAL, connect, frames_until, key_headers, ws_create
from tests.support import eventually, watch_group_joins

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def text_of(frames: list[dict]) -> str:
    return "".join(f["delta"] for f in frames if f["type"] == "response.output_text.delta")


async def lane(engine) -> dict:
    return engine.snapshot()[0]["lane"]


async def test_a_turn_streams_the_responses_events_and_matches_http(tiny_alias, api_key, mlx_engine):
    """API-3: the socket runs the same generation path as POST /v1/responses and sends its events."""
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input="Hello there", max_output_tokens=6, store=False)
    frames = await frames_until(socket, *WS_TERMINAL)
    types = [f["type"] for f in frames]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    assert frames[0]["session_cache"] in get_args(Outcome)  # SES-7's words
    final = frames[-1]["response"]
    streamed = text_of(frames)
    assert final["output"][0]["content"][0]["text"] == streamed
    assert final["usage"]["output_tokens"] == 6 or final["status"] == "completed"
    await socket.disconnect()

    http = await AsyncClient().post(
        "/v1/responses",
        data=json.dumps({"model": "tiny", "input": "Hello there", "max_output_tokens": 6, "store": False}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert http.json()["output"][0]["content"][0]["text"] == streamed  # greedy: the same text


async def test_two_turns_run_back_to_back_and_the_second_continues_the_first(tiny_alias, api_key, mlx_engine):
    """API-3: one socket runs turns in sequence; a turn continues the stored chain by id (PER-1)."""
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input="My name is Ada.", max_output_tokens=4)
    first = (await frames_until(socket, *WS_TERMINAL))[-1]
    assert first["type"] != "error", first
    await ws_create(
        socket, input="What is my name?", max_output_tokens=4, previous_response_id=first["response"]["id"]
    )
    second = (await frames_until(socket, *WS_TERMINAL))[-1]
    assert second["type"] != "error", second
    assert second["response"]["previous_response_id"] == first["response"]["id"]
    # The stored conversation carries turn one: the prompt of turn two is longer than its own input.
    assert second["response"]["usage"]["input_tokens"] > first["response"]["usage"]["input_tokens"]
    await socket.disconnect()


async def test_the_terminal_frame_carries_the_servers_timings(tiny_alias, api_key, mlx_engine, tiny_eos_id):
    """API-3, ADM-4: an extension of the socket's frames (the chat page's figures): a finished or
    cancelled turn's terminal frame has `timings`; the HTTP answer is unchanged."""
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input="Hello there", max_output_tokens=6, store=False)
    done = (await frames_until(socket, *WS_TERMINAL))[-1]
    timings = done["timings"]
    speculation = {"drafted_tokens", "accepted_tokens", "tokens_per_pass"}
    # The speculation figures come all three or none (a turn that could not draft).
    assert set(timings) - speculation == {"queue_ms", "ttft_ms", "prefill_tps", "decode_tps"}
    assert speculation <= set(timings) or not speculation & set(timings)
    if "tokens_per_pass" in timings:
        assert 0 <= timings["accepted_tokens"] <= timings["drafted_tokens"]
        assert timings["tokens_per_pass"] >= 1
    assert 0 <= timings["queue_ms"] <= timings["ttft_ms"]
    assert timings["prefill_tps"] > 0
    assert (timings["decode_tps"] > 0) == (done["response"]["usage"]["output_tokens"] > 1)
    assert "timings" not in done["response"]  # the response object stays OpenAI's

    no_eos = {str(tiny_eos_id): -100}
    await ws_create(socket, input="Count", max_output_tokens=100_000, logit_bias=no_eos, store=False)
    await frames_until(socket, "response.output_text.delta")
    await socket.send_to(text_data=json.dumps({"type": "response.cancel"}))
    cancelled = (await frames_until(socket, *WS_TERMINAL))[-1]
    assert cancelled["response"]["status"] == "cancelled"
    assert cancelled["timings"]["ttft_ms"] > 0
    await socket.disconnect()

    http = await AsyncClient().post(
        "/v1/responses",
        data=json.dumps({"model": "tiny", "input": "Hello", "max_output_tokens": 2, "store": False}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert "timings" not in http.json()


async def test_no_credentials_close_with_4401_before_accept(tiny_alias, mlx_engine):
    """API-5: no API key and no session: the handshake is refused with 4401, nothing is accepted."""
    socket = WebsocketCommunicator(application, WS_PATH, headers=[WS_HOST])
    connected, code = await socket.connect(timeout=10)
    assert (connected, code) == (False, 4401)


async def test_a_wrong_key_closes_with_4401(tiny_alias, mlx_engine):
    """API-5: an unknown key is refused like a missing one."""
    socket = WebsocketCommunicator(application, WS_PATH, headers=key_headers("sk-not-a-real-key-123456"))
    assert await socket.connect(timeout=10) == (False, 4401)


async def test_a_foreign_origin_is_rejected_even_with_a_valid_key(tiny_alias, api_key, mlx_engine):
    """API-5: the socket checks Origin; a page of another site cannot use it."""
    headers = key_headers(api_key, (b"origin", b"https://evil.example"))
    socket = WebsocketCommunicator(application, WS_PATH, headers=headers)
    assert await socket.connect(timeout=10) == (False, 4403)
    same_site = await connect(key_headers(api_key, (b"origin", b"http://testserver")))
    await same_site.disconnect()


async def test_a_session_counts_only_from_a_page_of_this_site(tiny_alias, mlx_engine, user):
    """API-5: the Django session authenticates a browser socket, which always sends Origin."""
    client = AsyncClient()
    await client.aforce_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    without_origin = WebsocketCommunicator(application, WS_PATH, headers=[WS_HOST, (b"cookie", cookie)])
    assert await without_origin.connect(timeout=10) == (False, 4401)
    socket = await connect([WS_HOST, (b"cookie", cookie), (b"origin", b"http://testserver")])
    await ws_create(socket, input="Hi", max_output_tokens=2, store=False)
    assert (await frames_until(socket, *WS_TERMINAL))[-1]["type"] != "error"
    await socket.disconnect()


async def test_an_api_key_in_the_first_frame_authenticates_when_asked_for(tiny_alias, api_key, mlx_engine):
    """API-5: `?auth=first-frame` accepts, then the first frame must carry a valid key."""
    socket = await connect([WS_HOST], path=f"{WS_PATH}?auth=first-frame")
    await socket.send_to(text_data=json.dumps({"type": "auth", "api_key": api_key}))
    assert json.loads(await socket.receive_from(timeout=10)) == {"type": "auth.ok"}
    await ws_create(socket, input="Hi", max_output_tokens=2, store=False)
    assert (await frames_until(socket, *WS_TERMINAL))[-1]["type"] != "error"
    await socket.disconnect()

    wrong = await connect([WS_HOST], path=f"{WS_PATH}?auth=first-frame")
    await ws_create(wrong, input="Hi")  # anything but an auth frame first
    assert (await wrong.receive_output(timeout=10)) == {"type": "websocket.close", "code": 4401}


async def test_bad_frames_get_error_frames_and_the_socket_stays_usable(tiny_alias, api_key, mlx_engine):
    """API-3, API-4: invalid JSON, an unknown type and an invalid body each get an error frame."""
    socket = await connect(key_headers(api_key))
    await socket.send_to(text_data="{not json")
    assert json.loads(await socket.receive_from(timeout=10))["error"]["code"] == "invalid_json"
    await socket.send_to(text_data=json.dumps({"type": "response.explode"}))
    assert json.loads(await socket.receive_from(timeout=10))["error"]["code"] == "unknown_frame_type"
    await ws_create(socket, input="Hi", max_output_tokens=-3)
    error = json.loads(await socket.receive_from(timeout=10))
    assert (error["type"], error["status"], error["error"]["param"]) == ("error", 400, "max_output_tokens")
    await ws_create(socket, model="no-such-model", input="Hi")
    error = json.loads(await socket.receive_from(timeout=10))
    assert (error["status"], error["error"]["code"]) == (404, "model_not_found")
    await ws_create(socket, input="Hi", max_output_tokens=2, store=False)
    assert (await frames_until(socket, *WS_TERMINAL))[-1]["type"] == "response.incomplete"
    await socket.disconnect()


async def test_an_oversized_frame_closes_with_1009(tiny_alias, api_key, mlx_engine, settings):
    """API-3: a frame over MLXHOST_WS_MAX_FRAME_BYTES closes the socket with 1009 (message too big)."""
    settings.MLXHOST_WS_MAX_FRAME_BYTES = 1000
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input="x" * 2000)
    assert await socket.receive_output(timeout=10) == {"type": "websocket.close", "code": 1009}


async def test_the_queue_position_is_reported_and_cancel_frees_the_slot(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """API-3, LANE-6: a waiting turn hears its position; a cancel frame ends the running turn with
    its terminal event (status cancelled) and the waiting one gets the slot."""
    no_eos = {str(tiny_eos_id): -100}
    first = await connect(key_headers(api_key))
    await ws_create(first, input="Count", max_output_tokens=100_000, logit_bias=no_eos, store=False)
    await frames_until(first, "response.output_text.delta")
    second = await connect(key_headers(api_key))
    await ws_create(second, input="Hi", max_output_tokens=3, logit_bias=no_eos, store=False)
    queued = json.loads(await second.receive_from(timeout=10))
    assert (queued["type"], queued["position"]) == ("response.queued", 1)
    assert (await lane(mlx_engine))["queued"] == 1

    await first.send_to(text_data=json.dumps({"type": "response.cancel"}))
    ended = (await frames_until(first, *WS_TERMINAL))[-1]
    assert (ended["type"], ended["response"]["status"]) == ("response.incomplete", "cancelled")
    done = (await frames_until(second, *WS_TERMINAL))[-1]
    assert done["response"]["usage"]["output_tokens"] == 3
    # The terminal event goes out before the engine frees the slot (a loop callback later).
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["active"] == 0, what="the slot to be freed")
    await first.disconnect()
    await second.disconnect()


async def test_closing_the_socket_cancels_the_running_turn_and_frees_the_slot(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """API-3, LANE-6: a closed socket stops its generation; /readyz shows the slot free."""
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input="Count", max_output_tokens=100_000, logit_bias={str(tiny_eos_id): -100})
    await frames_until(socket, "response.output_text.delta")
    await socket.disconnect()
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["active"] == 0, what="the slot to be freed")
    readyz = await AsyncClient().get("/readyz", headers={"Authorization": f"Bearer {api_key}"})
    assert readyz.json()["instances"][0]["lane"]["active"] == 0
    assert mlx_engine.snapshot()[0]["requests_cancelled"] == 1


async def test_a_socket_runs_at_most_its_limit_of_turns_at_once(tiny_alias, api_key, mlx_engine, tiny_eos_id):
    """API-3: a create beyond MLXHOST_WS_MAX_TURNS gets an error frame; the running turn goes on."""
    socket = await connect(key_headers(api_key))
    await ws_create(
        socket, input="Count", max_output_tokens=100_000, logit_bias={str(tiny_eos_id): -100}, store=False
    )
    await frames_until(socket, "response.output_text.delta")
    await ws_create(socket, input="Also")
    frames = await frames_until(socket, "error")
    assert frames[-1]["error"]["code"] == "too_many_turns"
    assert frames[-1]["status"] == 429
    await socket.send_to(text_data=json.dumps({"type": "response.cancel"}))
    assert (await frames_until(socket, *WS_TERMINAL))[-1]["response"]["status"] == "cancelled"
    await socket.disconnect()


async def test_the_dashboard_socket_pushes_each_published_status_to_staff(
    tiny_alias, mlx_engine, django_user_model, monkeypatch
):
    """ADM-2: staff sockets join the dashboard group and get every engine status as it is published;
    anyone else is refused before accept."""
    from models_app.catalogue import live_status as engine_status
    from models_app.catalogue import reconcile as engine_control
    from models_app.catalogue.control import ENGINE_GROUP

    staff = await django_user_model.objects.acreate(username="root", is_staff=True, is_superuser=True)
    client = AsyncClient()
    await client.aforce_login(staff)
    cookie = (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())
    origin = (b"origin", b"http://testserver")
    anonymous = WebsocketCommunicator(application, "/ws/dashboard", headers=[WS_HOST, origin])
    assert await anonymous.connect(timeout=10) == (False, 4401)

    await mlx_engine.load(selectors_spec(tiny_alias), name="tiny")
    actions = engine_control.Actions(mlx_engine)
    # The control listener runs beside the sockets, as under daphne: with channels_redis it must
    # not take over the process's receive loop from the consumers.
    layer, prefixes = get_channel_layer(), []
    joined = watch_group_joins(monkeypatch, layer, ENGINE_GROUP)
    new_channel = layer.new_channel
    layer.new_channel = lambda *args, **kwargs: (
        prefixes.append(args + tuple(kwargs.values())) or new_channel(*args, **kwargs)
    )
    try:
        listener = asyncio.create_task(engine_control.run_control_listener(mlx_engine, actions))
        await asyncio.wait_for(joined.wait(), 10)  # it waits for messages before the socket joins
    finally:
        del layer.new_channel
    # channels_redis reads all of a process's channels through the one list of the default prefix;
    # a channel of another prefix would take that loop over and starve the consumers.
    assert prefixes == [()]
    socket = await connect([WS_HOST, cookie, origin], path="/ws/dashboard")
    publisher = asyncio.create_task(engine_status.run_status_publisher(mlx_engine, actions))
    try:
        for _ in range(50):  # frames from earlier engines' cached statuses may come first
            frame = json.loads(await socket.receive_from(timeout=10))
            if frame["status"]["instances"]:
                break
        assert frame["type"] == "status"
        assert frame["status"]["instances"][0]["aliases"] == ["tiny"]
        assert frame["status"]["instances"][0]["state"] == "ready"
    finally:
        publisher.cancel()
        listener.cancel()
        await socket.disconnect()


def selectors_spec(alias):
    from models_app.catalogue import specs

    return specs.model_spec_for(alias=alias)


async def test_a_full_lane_sends_an_overloaded_error_frame(tiny_alias, api_key, mlx_engine, tiny_eos_id):
    """LANE-2: over budget on the socket is an `overloaded` error frame with retry_after (not the
    429-style `rate_limit_error`); the socket stays open and the running turn goes on."""
    from tests.api.support import set_lane

    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    no_eos = {str(tiny_eos_id): -100}
    holder = await connect(key_headers(api_key))
    await ws_create(holder, input="Count", max_output_tokens=100_000, logit_bias=no_eos, store=False)
    await frames_until(holder, "response.output_text.delta")

    refused = await connect(key_headers(api_key))
    await ws_create(refused, input="Hi", max_output_tokens=2, store=False)
    frame = json.loads(await refused.receive_from(timeout=10))
    assert frame["type"] == "error"
    assert (frame["error"]["type"], frame["error"]["code"]) == ("overloaded", "queue_full")
    assert frame["retry_after"] >= 1 and frame["response_id"].startswith("resp_")
    assert (await lane(mlx_engine))["active"] == 1

    await holder.send_to(text_data=json.dumps({"type": "response.cancel"}))
    assert (await frames_until(holder, *WS_TERMINAL))[-1]["response"]["status"] == "cancelled"
    await ws_create(refused, input="Hi", max_output_tokens=2, store=False)  # the same socket, later
    assert (await frames_until(refused, *WS_TERMINAL))[-1]["type"] == "response.incomplete"
    await holder.disconnect()
    await refused.disconnect()


async def test_a_full_lane_refuses_a_frame_before_it_is_validated(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """LANE-2 (issue 25 §4): on a full lane a `response.create` is refused before validation: a
    frame that would fail it hears `overloaded`; with room again, the same frame hears its 400."""
    from tests.api.support import set_lane

    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    holder = await connect(key_headers(api_key))
    no_eos = {str(tiny_eos_id): -100}
    await ws_create(holder, input="Count", max_output_tokens=100_000, logit_bias=no_eos, store=False)
    await frames_until(holder, "response.output_text.delta")
    refused = await connect(key_headers(api_key))
    await ws_create(refused, input="Hi", temperature="hot", store=False)
    frame = json.loads(await refused.receive_from(timeout=10))
    assert (frame["type"], frame["status"], frame["error"]["code"]) == ("error", 429, "queue_full")
    assert frame["response_id"].startswith("resp_")

    await holder.send_to(text_data=json.dumps({"type": "response.cancel"}))
    await frames_until(holder, *WS_TERMINAL)
    await ws_create(refused, input="Hi", temperature="hot", store=False)
    frame = json.loads(await refused.receive_from(timeout=10))
    assert (frame["type"], frame["status"]) == ("error", 400)
    await holder.disconnect()
    await refused.disconnect()


async def test_a_frame_costs_no_extra_hop_to_the_sync_thread(tiny_alias, api_key, mlx_engine, monkeypatch):
    """Issue 25 §4: channels closed stale database connections before every frame, one hop to
    asgiref's one sync thread each; a frame now goes straight to its handler (the connect and
    the disconnect keep the hop)."""
    import channels.consumer

    hops: list[int] = []
    original = channels.consumer.aclose_old_connections

    async def counted() -> None:
        hops.append(1)
        await original()

    monkeypatch.setattr(channels.consumer, "aclose_old_connections", counted)
    socket = await connect(key_headers(api_key))
    connected = len(hops)
    assert connected >= 1
    for _ in range(3):
        await socket.send_to(text_data=json.dumps({"type": "nope"}))
        assert json.loads(await socket.receive_from(timeout=10))["type"] == "error"
    assert len(hops) == connected
    await socket.disconnect()


async def test_hostile_frames_get_error_frames(tiny_alias, api_key, mlx_engine):
    """API-4: a 10,000-deep frame and a lone surrogate are error frames, not a crashed consumer."""
    socket = await connect(key_headers(api_key))
    await socket.send_to(text_data="[" * 10_000 + "]" * 10_000)
    assert json.loads(await socket.receive_from(timeout=10))["error"]["code"] == "invalid_json"
    await socket.send_to(text_data='{"type": "response.create", "model": "tiny", "input": "\\ud800"}')
    assert json.loads(await socket.receive_from(timeout=10))["error"]["code"] == "invalid_json"
    await ws_create(socket, input="Hi", max_output_tokens=2, store=False)
    assert (await frames_until(socket, *WS_TERMINAL))[-1]["type"] == "response.incomplete"
    await socket.disconnect()


async def test_revoking_a_key_closes_its_open_socket_with_4401_and_stops_its_turn(
    tiny_alias, user, mlx_engine, tiny_eos_id
):
    """API-5: a revoked key's socket is closed (4401) at once, through the channel layer, and
    its running turn stops; other keys' sockets stay open."""
    from asgiref.sync import sync_to_async

    from models_app.catalogue import services

    key, raw = await sync_to_async(services.apikey_create)(owner=user, name="doomed")
    _, other_raw = await sync_to_async(services.apikey_create)(owner=user, name="kept")
    socket = await connect(key_headers(raw))
    kept = await connect(key_headers(other_raw))
    await ws_create(socket, input="Count", max_output_tokens=100_000, logit_bias={str(tiny_eos_id): -100})
    await frames_until(socket, "response.output_text.delta")

    await sync_to_async(services.apikey_revoke)(key=key)
    while (output := await socket.receive_output(timeout=10))["type"] != "websocket.close":
        pass  # deltas already on their way
    assert output == {"type": "websocket.close", "code": 4401}
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["active"] == 0, what="the slot to be freed")
    assert await kept.receive_nothing(timeout=0.2)
    await ws_create(kept, input="Hi", max_output_tokens=2, store=False)
    assert (await frames_until(kept, *WS_TERMINAL))[-1]["type"] == "response.incomplete"
    await kept.disconnect()


async def test_a_key_given_in_the_first_frame_is_watched_too(tiny_alias, user, mlx_engine):
    """API-5: revocation also closes a socket that authenticated with its first frame."""
    from asgiref.sync import sync_to_async

    from models_app.catalogue import services

    key, raw = await sync_to_async(services.apikey_create)(owner=user, name="first-frame")
    socket = await connect([WS_HOST], path=f"{WS_PATH}?auth=first-frame")
    await socket.send_to(text_data=json.dumps({"type": "auth", "api_key": raw}))
    assert json.loads(await socket.receive_from(timeout=10)) == {"type": "auth.ok"}
    await sync_to_async(services.apikey_revoke)(key=key)
    assert await socket.receive_output(timeout=10) == {"type": "websocket.close", "code": 4401}


async def test_logging_out_closes_the_sessions_sockets_with_4401(tiny_alias, mlx_engine, django_user_model):
    """API-5: a logout (Django's user_logged_out) closes the sockets its session opened, the
    playground's and the dashboard's; another session of the same user stays open."""
    staff = await django_user_model.objects.acreate(username="ops", is_staff=True)
    origin = (b"origin", b"http://testserver")
    client, other = AsyncClient(), AsyncClient()
    await client.aforce_login(staff)
    await other.aforce_login(staff)
    cookie = (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())
    other_cookie = (b"cookie", f"sessionid={other.cookies['sessionid'].value}".encode())
    playground = await connect([WS_HOST, cookie, origin])
    dashboard = await connect([WS_HOST, cookie, origin], path="/ws/dashboard")
    survivor = await connect([WS_HOST, other_cookie, origin])

    await client.alogout()
    assert await playground.receive_output(timeout=10) == {"type": "websocket.close", "code": 4401}
    while (output := await dashboard.receive_output(timeout=10))["type"] != "websocket.close":
        pass  # status frames sent before the logout
    assert output["code"] == 4401
    assert await survivor.receive_nothing(timeout=0.2)
    await survivor.disconnect()


async def test_an_expired_session_is_caught_by_the_periodic_recheck(tiny_alias, mlx_engine, user, settings):
    """API-5: a session that ends without a logout (expiry, deleted row) closes its socket with
    4401 at the next re-check (MLXHOST_WS_AUTH_RECHECK_S)."""
    from django.contrib.sessions.models import Session

    settings.MLXHOST_WS_AUTH_RECHECK_S = 0.05
    client = AsyncClient()
    await client.aforce_login(user)
    session_key = client.cookies["sessionid"].value
    socket = await connect(
        [WS_HOST, (b"cookie", f"sessionid={session_key}".encode()), (b"origin", b"http://testserver")]
    )
    assert await socket.receive_nothing(timeout=0.3)  # several re-checks pass while it is live
    await Session.objects.filter(session_key=session_key).adelete()
    assert await socket.receive_output(timeout=10) == {"type": "websocket.close", "code": 4401}


async def _session_sockets(django_user_model, username: str):
    """A logged-in staff client and the playground and dashboard sockets its session opened."""
    staff = await django_user_model.objects.acreate(username=username, is_staff=True)
    client = AsyncClient()
    await client.aforce_login(staff)
    headers = [
        WS_HOST,
        (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()),
        (b"origin", b"http://testserver"),
    ]
    return client, await connect(headers), await connect(headers, path="/ws/dashboard")


async def test_a_logged_out_socket_cannot_start_a_turn_when_no_close_message_came(
    tiny_alias, mlx_engine, django_user_model, settings, monkeypatch
):
    """API-5: a logout in a process that shares no channel layer with this one sends no close
    message; the socket's next frame re-checks the session, closes it with 4401 and runs nothing."""
    from models_app.catalogue import control

    settings.MLXHOST_WS_AUTH_RECHECK_S = 3600  # only the per-frame check can catch it here
    monkeypatch.setattr(control, "sockets_close_rollback_unsafe", lambda *, group: None)
    client, playground, dashboard = await _session_sockets(django_user_model, "elsewhere")
    await ws_create(playground, input="Hi", max_output_tokens=2, store=False)
    assert (await frames_until(playground, *WS_TERMINAL))[-1]["type"] == "response.incomplete"

    await client.alogout()
    assert await playground.receive_nothing(timeout=0.2)  # no message came: still open
    await ws_create(playground, input="Hi again", max_output_tokens=2, store=False)
    assert await playground.receive_output(timeout=10) == {"type": "websocket.close", "code": 4401}
    assert await playground.receive_nothing(timeout=0.2)  # no turn started: not one event
    assert mlx_engine.snapshot()[0]["requests_finished"] == 1  # only the turn before the logout
    await dashboard.disconnect()


async def test_a_logged_out_dashboard_gets_no_more_status_frames(tiny_alias, mlx_engine, django_user_model):
    """API-5, ADM-2: once the logout closed it (4401), the dashboard socket sends nothing more,
    though status messages keep arriving for its group until the client hangs up."""
    from models_app.catalogue.control import DASHBOARD_GROUP, DASHBOARD_STATUS

    client, playground, dashboard = await _session_sockets(django_user_model, "watcher")
    await client.alogout()
    while (output := await dashboard.receive_output(timeout=10))["type"] != "websocket.close":
        pass  # status frames sent before the logout
    assert output["code"] == 4401
    await get_channel_layer().group_send(DASHBOARD_GROUP, {"type": DASHBOARD_STATUS, "status": {"n": 1}})
    assert await dashboard.receive_nothing(timeout=0.3)
    assert await playground.receive_output(timeout=10) == {"type": "websocket.close", "code": 4401}


async def test_a_logout_closes_the_sockets_within_seconds_by_the_recheck_alone(
    tiny_alias, mlx_engine, django_user_model, settings, monkeypatch
):
    """API-5: with no close message (no shared channel layer), the periodic re-check closes an
    idle logged-out socket with 4401 within MLXHOST_WS_AUTH_RECHECK_S."""
    from models_app.catalogue import control

    settings.MLXHOST_WS_AUTH_RECHECK_S = 0.1
    monkeypatch.setattr(control, "sockets_close_rollback_unsafe", lambda *, group: None)
    client, playground, dashboard = await _session_sockets(django_user_model, "idle")
    assert await playground.receive_nothing(timeout=0.3)  # live: several re-checks pass
    await client.alogout()
    assert await playground.receive_output(timeout=5) == {"type": "websocket.close", "code": 4401}
    while (output := await dashboard.receive_output(timeout=5))["type"] != "websocket.close":
        pass
    assert output["code"] == 4401
