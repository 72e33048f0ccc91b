"""The engine's promises through HTTP and the control plane: permit before parent, draining admin
actions, weights re-verified at load, snapshots on the loop, fixed load-failure texts."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import AsyncClient

from api.errors import LOAD_FAILED_MESSAGE, as_api_error, failed_error
from mlxhost import runtime
from mlxhost.engine import Engine, EngineConfig, Failed, InvalidModelFolderError, ModelLoadError
from models_app.catalogue import reconcile as engine_control
from models_app.models import ModelAlias
from tests.api.support import ScriptedGeneration, StreamReader, every_auth, post_chat, set_lane, settled
from tests.api.support import post_any as post
from tests.support import eventually, register_alias

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


async def test_a_continuation_on_a_full_lane_is_refused_429_before_its_parent_is_read(
    tiny_alias, api_key, mlx_engine, tiny_eos_id, monkeypatch
):
    """LANE-3, LANE-2: the permit comes before the stored chain, so a full lane answers 429
    (not the parent's 404) and never waits for a pending parent write."""
    from models_app.persistence import persistence

    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    holder = await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias={str(tiny_eos_id): -100})
    fetched = []

    async def fetch(self, **kwargs):
        fetched.append(kwargs)
        raise AssertionError("the parent was read before admission")

    monkeypatch.setattr(persistence.Persistence, "fetch", fetch, raising=True)
    try:
        body = {"model": "tiny", "input": "and then?", "previous_response_id": "resp_" + "0" * 32}
        refused = await post(api_key, "/v1/responses", body)
        assert refused.status_code == 429, refused.content
        assert refused.json()["error"]["code"] == "queue_full"
        assert fetched == []
        assert mlx_engine.snapshot()[0]["lane"]["permits"] == 0  # nothing leaked
    finally:
        mlx_engine.cancel(holder["X-Request-Id"])


async def test_a_missing_parent_releases_the_permit(tiny_alias, api_key, mlx_engine):
    """LANE-3: a continuation that bails out after taking its permit (404 parent) gives it back."""
    await post_chat(api_key, max_tokens=1)  # loaded
    missing = await post(
        api_key, "/v1/responses", {"model": "tiny", "input": "x", "previous_response_id": "resp_nope"}
    )
    assert missing.status_code == 404
    assert mlx_engine.snapshot()[0]["lane"]["permits"] == 0


@pytest.fixture
async def draining_engine():
    """An engine whose admin drains abort running streams after 0.3 s (DRAIN_TIMEOUT_S)."""
    engine = Engine(EngineConfig(backend="mlx", drain_timeout_s=0.3))
    runtime.PROCESS.put(runtime.ENGINE, engine)
    yield engine
    runtime.PROCESS.put(runtime.ENGINE, None)
    await engine.shutdown()


async def test_an_admin_unload_drains_refuses_arrivals_and_aborts_streams_at_the_timeout(
    tiny_alias, api_key, draining_engine, tiny_eos_id
):
    """LANE-7, ADM-1: an admin unload refuses new arrivals at once (503 / 529 `draining`),
    cancels queued waiters, aborts a running stream at the drain timeout (its stream ends with
    an error event, not `finish_reason: stop`), frees the instance, and the next request loads
    it again."""
    no_eos = {str(tiny_eos_id): -100}
    running = await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias=no_eos)
    reader = StreamReader(running)
    await reader.wait_for(2)
    queued = asyncio.create_task(post_chat(api_key, max_tokens=2))
    await eventually(lambda: draining_engine.snapshot()[0]["lane"]["queued"] == 1, timeout=30)
    actions = engine_control.Actions(draining_engine)
    unload = asyncio.create_task(actions.run("tiny", "unload"))
    await eventually(lambda: draining_engine.snapshot()[0]["lane"]["draining"], timeout=30)

    arrival = await post_chat(api_key, max_tokens=2)
    assert (arrival.status_code, arrival.json()["error"]["code"]) == (503, "draining")
    anthropic = await post(
        api_key,
        "/v1/messages",
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert anthropic.status_code == 529
    waiter = await queued
    assert (waiter.status_code, waiter.json()["error"]["code"]) == (503, "draining")

    await asyncio.wait_for(unload, 30)  # the stream was aborted at the timeout, then freed
    assert settled(actions, "tiny", "unload") and actions.results["tiny"]["state"] == "done"
    await asyncio.wait_for(reader._task, 10)
    assert draining_engine.snapshot()[0]["state"] == "unloaded"
    again = await post_chat(api_key, max_tokens=2)
    assert again.status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, id="chat"),
        pytest.param("/v1/completions", {"prompt": "Once upon a time"}, id="completions"),
    ],
)
async def test_an_aborted_stream_ends_with_a_finish_reason_then_the_error_and_done(
    tiny_alias, api_key, draining_engine, tiny_eos_id, path, body
):
    """LANE-7, OPS-5 (issue 25): a stream cut short by a drain ends with a final chunk whose
    finish_reason is `abort` (never `stop`, which reads like a complete answer), its usage when
    asked for, then an OpenAI error (code `draining`) that says why, then `[DONE]`."""
    no_eos = {str(tiny_eos_id): -100}
    request = {"model": "tiny", "stream": True, "max_tokens": 100_000, "logit_bias": no_eos, **body}
    running = await post(api_key, path, {**request, "stream_options": {"include_usage": True}})
    chunks: list[bytes] = []

    async def read() -> None:
        async for chunk in running.streaming_content:
            chunks.append(chunk)

    reader = asyncio.create_task(read())
    await eventually(lambda: len(chunks) >= 3, timeout=30)
    await draining_engine.drain(draining_engine.snapshot()[0]["instance_id"], "wait", timeout=0.05)
    await asyncio.wait_for(reader, 10)
    frames = [
        line.removeprefix(b"data: ")
        for chunk in chunks
        for line in chunk.split(b"\n")
        if line.startswith(b"data: ")
    ]
    assert frames[-1] == b"[DONE]"
    assert json.loads(frames[-2])["error"]["code"] == "draining"
    payloads = [json.loads(f) for f in frames[:-2]]
    finishes = [c["finish_reason"] for p in payloads for c in p.get("choices", [])]
    assert finishes[-1] == "abort" and set(finishes[:-1]) == {None}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] >= 1


async def test_after_the_drain_every_surface_says_draining(tiny_alias, api_key, draining_engine):
    """LANE-7, OPS-5 (issue 25): once shutdown has drained the engine, a request that still
    arrives hears what the drain said: 503 `draining` with Retry-After on OpenAI's surfaces, 529
    `overloaded_error` on Anthropic's; never 503 `engine_closed` or `api_error`."""
    assert (await post_chat(api_key, max_tokens=1)).status_code == 200  # bound and loaded
    await draining_engine.shutdown()
    hello = [{"role": "user", "content": "Hi"}]
    for path, body in [
        ("/v1/chat/completions", {"messages": hello}),
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/responses", {"input": "Hi"}),
    ]:
        refused = await post(api_key, path, {"model": "tiny", **body})
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "draining"), path
        assert int(refused["Retry-After"]) >= 1
    for path, body in [("/v1/messages", {"max_tokens": 2}), ("/v1/messages/count_tokens", {})]:
        refused = await post(api_key, path, {"model": "tiny", "messages": hello, **body})
        assert refused.status_code == 529, path
        assert refused.json()["error"]["type"] == "overloaded_error", path


@pytest.fixture
def changing_folder(tiny_model_dir):
    """A tiny model folder of this test's own, whose weights the test rewrites."""
    folder = settings.MODELS_ROOT / "tiny-changing"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(tiny_model_dir, folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_weights_changed_on_disk_are_registered_anew_not_stamped_with_the_old_id(
    changing_folder, tiny_model_b_dir, api_key, mlx_engine
):
    """REG-3, OPS-4: a load re-hashes the folder; when the files changed since the alias was
    saved, the client gets a fixed 503 with Retry-After (no path), and the new weights are
    registered under a new instance id, which then serves the alias."""
    alias = await sync_to_async(register_alias)(name="changing", folder="tiny-changing", temperature=0.0)
    old_id = alias.instance_id
    for weights in tiny_model_b_dir.glob("*.safetensors"):  # same shapes, other values
        shutil.copyfile(weights, changing_folder / weights.name)
    actions = engine_control.Actions(mlx_engine)
    mlx_engine.on_weights_changed(actions.weights_changed)

    body = {"model": "changing", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    failed = await post(api_key, "/v1/chat/completions", body)
    assert failed.status_code == 503
    assert failed.json()["error"]["message"] == LOAD_FAILED_MESSAGE
    assert str(settings.MODELS_ROOT) not in failed.content.decode()
    assert int(failed["Retry-After"]) >= 1

    await eventually(lambda: settled(actions, "changing", "reload"), timeout=30)
    assert actions.results["changing"]["state"] == "done", actions.results["changing"]
    fresh = await ModelAlias.objects.select_related("model__instance").aget(name="changing")
    assert fresh.instance_id != old_id
    served = await post(api_key, "/v1/chat/completions", body)
    assert served.status_code == 200
    assert served.json()["system_fingerprint"] == f"fp_mlxhost_{fresh.instance_id}"


async def test_models_list_snapshots_the_engine_on_the_event_loop(
    tiny_alias, api_key, mlx_engine, monkeypatch
):
    """REG-8: /v1/models reads the engine's lanes and sessions on the loop that owns them, never
    from a worker thread (which could see them mutate mid-iteration)."""
    await post_chat(api_key, max_tokens=1)
    threads = []
    original = mlx_engine.snapshot

    def snapshot():
        threads.append(threading.current_thread())
        return original()

    monkeypatch.setattr(mlx_engine, "snapshot", snapshot)
    listing = await AsyncClient().get("/v1/models", headers=every_auth(api_key))
    assert listing.json()["data"][0]["state"] == "ready"
    assert threads == [threading.current_thread()]  # the test's loop thread


def test_load_failures_show_clients_a_fixed_text_with_retry_after():
    """API-4, OPS-4: a load failure's detail (paths) stays in the log; clients get 503, a fixed
    message and Retry-After, from the exception and from a generation's Failed event alike."""
    for exc in (
        InvalidModelFolderError("'/srv/models/x' has no config.json."),
        ModelLoadError("FileNotFoundError: /srv/models/x/model.safetensors"),
    ):
        error = as_api_error(exc)
        assert (error.status, error.message, error.code) == (503, LOAD_FAILED_MESSAGE, "model_load_failed")
        assert error.retry_after and error.retry_after >= 1
    reload_failed = failed_error(Failed(code="model_load_failed", message="OSError: /srv/models/x"))
    assert (reload_failed.status, reload_failed.message) == (503, LOAD_FAILED_MESSAGE)
    assert reload_failed.retry_after and reload_failed.retry_after >= 1


async def test_an_aborted_responses_stream_ends_incomplete_and_says_why():
    """LANE-7, OPS-5: a Responses stream cut short by a drain ends with `response.incomplete`,
    status `incomplete` and reason `draining`, never `response.completed`."""
    from api.openai.responses import ResponseTurn, response_events
    from mlxhost.engine import Delta, Done, Started, Timings, Usage
    from models_app.turns.turns import StartedTurn, TurnHooks

    class Recorded(TurnHooks):
        def __init__(self) -> None:
            self.results = []

        def ended(self, result):
            self.results.append(result)

    done = Done(finish_reason="aborted", usage=Usage(3, 1), timings=Timings(0, 0, 0, 0))
    generation = ScriptedGeneration(Started(prompt_tokens=3), Delta(text="Hi"), done)
    hooks = Recorded()
    turn = ResponseTurn("resp_x", "tiny", None, None, False, None, None, None, {})
    started = StartedTurn("resp_x", "tiny", generation, hooks)
    events = [event async for event in response_events(turn, started)]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "draining"}
    assert [(r.text, r.event) for r in hooks.results] == [("Hi", done)]  # the service recorded it once


async def test_a_turn_whose_caller_gives_up_while_queued_is_cancelled_not_left_to_run(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """LANE-6: when the queue-position callback fails (the socket closed under it), the queued
    turn is cancelled; before, it stayed queued and later ran its whole answer for nobody."""
    from models_app.turns.response_request import ResponseRequest
    from models_app.turns.response_turns import response_start

    await set_lane(tiny_alias, concurrency=1, queue_depth=2)
    holder = await post_chat(api_key, stream=True, max_tokens=100_000, logit_bias={str(tiny_eos_id): -100})
    tenant = (await ModelAlias.objects.aget(name="tiny")).pk  # any tenant id will do here

    async def socket_closed(_position: int) -> None:
        raise ConnectionError("Attempt to send on a closed protocol")

    request = ResponseRequest(model="tiny", turns=({"role": "user", "content": "hi"},), store=False)
    try:
        with pytest.raises(ConnectionError):
            await response_start(request, tenant, response_id="resp_gone", on_queued=socket_closed)
        assert mlx_engine.snapshot()[0]["lane"]["queued"] == 0  # out of the queue at once
        await eventually(lambda: "resp_gone" not in mlx_engine.turns.live, timeout=30)  # and forgotten
    finally:
        mlx_engine.cancel(holder["X-Request-Id"])
