"""Two engine hosts behind HAProxy on PostgreSQL and Redis (OPS-8, OPS-9, OPS-10): continuations go home warm,
pending writes are seen fleet-wide, cancel works from anywhere, admin edits reach both hosts, a
fleet reload rolls, and a host killed mid-run leaves the survivor serving."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from models_app.turns.response_ids import home_host
from tests.fleet.conftest import both_hosts_ready
from tests.support import wait_until

if TYPE_CHECKING:
    from deploy.fleet import Fleet

# Sequences reset with each flush, so the content types the flush re-creates keep their ids: the
# admin-only process caches them (its history entries would point at vanished ids otherwise).
pytestmark = [
    pytest.mark.fleet,
    pytest.mark.django_db(transaction=True, reset_sequences=True),
    pytest.mark.timeout(600),
]

WARM = ("hit", "disk")
CLIENTS = 6  # concurrent clients of the rolling reload: each host's lane holds 4 running, 8 queued
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".cache" / "artifacts"


def text_of(body: dict[str, Any]) -> str:
    """A Responses body's answer text (what the SDKs call `output_text`)."""
    return "".join(
        part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"]
    )


def client(base: str, api_key: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)


def turn(http: httpx.Client, text: str, previous: str | None = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": "tiny", "input": text, "max_output_tokens": 8, **extra}
    if previous is not None:
        body["previous_response_id"] = previous
    return http.post("/v1/responses", json=body)


def test_chains_continue_warm_on_the_host_that_made_them(fleet: Fleet, fleet_alias, api_key):
    """20 chains of 3 turns through the proxy: every continuation reaches its parent's host and at
    least 90 % of them reuse its KV cache."""
    both_hosts_ready(fleet)
    outcomes: list[str] = []
    first_homes: set[int | None] = set()
    with client(fleet.url, api_key) as http:
        for chain in range(20):
            first = turn(http, f"Chain {chain}: tell me about the number {chain}.")
            assert first.status_code == 200, first.text
            parent = first.json()["id"]
            first_homes.add(home_host(parent))
            for n in (2, 3):
                answer = turn(http, f"Turn {n} of chain {chain}: go on.", parent)
                assert answer.status_code == 200, answer.text
                body = answer.json()
                assert body["previous_response_id"] == parent and body["status"] in (
                    "completed",
                    "incomplete",
                )
                assert home_host(body["id"]) == home_host(parent)  # served where the parent was made
                outcomes.append(answer.headers["x-session-cache"])
                parent = body["id"]
    warm = sum(outcome in WARM for outcome in outcomes)
    # The measured share, for the record (CI keeps .cache/artifacts/).
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "fleet-chains.json").write_text(
        json.dumps({"continuations": len(outcomes), "warm": warm, "outcomes": outcomes}, indent=1)
    )
    assert warm / len(outcomes) >= 0.9, outcomes
    assert first_homes == {1, 2}  # new conversations spread over both hosts


def test_a_continuation_on_the_other_host_waits_for_its_parent_row(fleet: Fleet, fleet_alias, api_key):
    """While the parent's row is still being written (the worker is paused), the other host knows it
    is pending (Redis) and answers 503 storage_timeout, never 404; once it lands, it continues the
    chain cold with the same text as the warm host."""
    both_hosts_ready(fleet)
    worker = fleet.procs["worker"].process
    assert worker is not None
    with client(fleet.host(1).url, api_key) as one, client(fleet.host(2).url, api_key) as two:
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            parent = turn(one, "A question asked on host one.").json()["id"]
            early = turn(two, "And a follow-up on host two.", parent)
            assert early.status_code == 503, early.text
            assert early.json()["error"]["code"] == "storage_timeout"
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        cold = turn(two, "And a follow-up on host two.", parent)
        warm = turn(one, "And a follow-up on host two.", parent)
    assert (cold.status_code, warm.status_code) == (200, 200), (cold.text, warm.text)
    # Host two never held the parent: it rebuilt the chain from the stored row (a shared template
    # prefix of its own may still be reused, so its outcome is not asserted).
    assert home_host(cold.json()["id"]) == 2 and warm.headers["x-session-cache"] in WARM
    assert text_of(cold.json()) == text_of(warm.json())


class StreamWatch:
    """A streamed Responses turn read in a thread: its id, the events seen and how it ended."""

    def __init__(self, base: str, api_key: str, body: dict[str, Any]) -> None:
        self.id: str | None = None
        self.events: list[dict[str, Any]] = []
        self.failure: BaseException | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base, api_key, body), daemon=True)
        self._thread.start()

    def _run(self, base: str, api_key: str, body: dict[str, Any]) -> None:
        try:
            with (
                client(base, api_key) as http,
                http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response,
            ):
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        self.events.append(event)
                        if event["type"] == "response.created":
                            self.id = event["response"]["id"]
                        elif event["type"] == "response.output_text.delta":
                            self.started.set()
        except BaseException as exc:  # a host killed mid-stream: the connection drops
            self.failure = exc
        finally:
            self.started.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"

    @property
    def terminal(self) -> str | None:
        kinds = [e["type"] for e in self.events]
        return next((k for k in reversed(kinds) if k in ("response.completed", "response.incomplete")), None)

    @property
    def status(self) -> str | None:
        return self.events[-1]["response"]["status"] if self.terminal else None


def endless(eos_id: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "input": "Go on for as long as you can.",
        "max_output_tokens": 100_000,
        "logit_bias": {str(eos_id): -100},
    }


@pytest.mark.parametrize("via", ["proxy", "other-host"])
def test_a_cancel_stops_a_stream_on_either_host(fleet: Fleet, fleet_alias, api_key, tiny_eos_id, via):
    """Through the proxy (which routes by the id's host) or sent straight to the other host (which
    passes it on over the channel layer), a cancel stops the stream wherever it runs."""
    both_hosts_ready(fleet)
    for n in (1, 2):
        watch = StreamWatch(fleet.host(n).url, api_key, endless(tiny_eos_id))
        assert watch.started.wait(60) and watch.id is not None, watch.failure
        assert home_host(watch.id) == n
        base = fleet.url if via == "proxy" else fleet.host(3 - n).url
        with client(base, api_key) as http:
            cancelled = http.post(f"/v1/responses/{watch.id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        watch.join(30)
        assert watch.status == "cancelled", watch.events[-1:]


class FormFields(HTMLParser):
    """The fields of one form (by id) as a browser would submit them."""

    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id, self.inside, self.fields = form_id, False, {}
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.inside = a.get("id") == self.form_id
        if not self.inside or ("name" not in a and tag in ("input", "select", "textarea")):
            return
        if tag == "input" and a.get("type") not in ("submit", "button", "file"):
            if a.get("type") in ("checkbox", "radio") and "checked" not in a:
                return
            self.fields[a["name"]] = a.get("value", "on" if a.get("type") == "checkbox" else "")
        elif tag == "select":
            self._select = a["name"]
        elif tag == "option" and self._select and "selected" in a:
            self.fields[self._select] = a.get("value", "")
        elif tag == "textarea":
            self._textarea = a["name"]
            self.fields[a["name"]] = ""

    def handle_data(self, data: str) -> None:
        if self._textarea:
            self.fields[self._textarea] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None
        elif tag == "form":
            self.inside = False


def staff_session(fleet: Fleet, django_user_model) -> httpx.Client:
    """A staff login on the admin-only process, through the proxy."""
    from django.contrib.auth.hashers import PBKDF2PasswordHasher

    user = django_user_model.objects.create_superuser(username="fleet-admin", password="unused")
    # The fleet runs the production settings (PBKDF2), not the tests' fast MD5 hasher.
    hashed = PBKDF2PasswordHasher().encode("pw-fleet-admin-1", PBKDF2PasswordHasher().salt())
    django_user_model.objects.filter(pk=user.pk).update(password=hashed)
    http = httpx.Client(base_url=fleet.url, timeout=30, follow_redirects=True)
    http.get("/admin/login/")
    login = http.post(
        "/admin/login/?next=/admin/",
        data={
            "username": "fleet-admin",
            "password": "pw-fleet-admin-1",
            "csrfmiddlewaretoken": http.cookies["csrftoken"],
        },
        headers={"Referer": f"{fleet.url}/admin/login/"},
    )
    assert login.status_code == 200 and "sessionid" in http.cookies, login.text[-500:]
    return http


def lane_capacity(base: str, api_key: str, alias: str) -> int | None:
    body = httpx.get(f"{base}/readyz", headers={"Authorization": f"Bearer {api_key}"}, timeout=5).json()
    found = [i for i in body.get("instances", []) if alias in i["aliases"]]
    return found[0]["lane"]["capacity"] if found else None


def test_an_admin_edit_on_the_admin_process_reaches_both_hosts(
    fleet: Fleet, fleet_alias, api_key, django_user_model
):
    """The model's lane, edited in the admin served by the admin-only process, is applied by both
    engine hosts within 5 s."""
    both_hosts_ready(fleet)
    for n in (1, 2):  # each host serves the alias (binds its lane)
        with client(fleet.host(n).url, api_key) as http:
            assert turn(http, "warm up").status_code == 200
        assert lane_capacity(fleet.host(n).url, api_key, "tiny") == 4
    model = fleet_alias.model
    with contextlib.closing(staff_session(fleet, django_user_model)) as admin:
        page = admin.get(f"/admin/models_app/model/{model.pk}/change/")
        form = FormFields("model_form")
        form.feed(page.text)
        assert "concurrency" in form.fields, sorted(form.fields)
        form.fields.update(concurrency="3", _save="Save")
        saved = admin.post(
            f"/admin/models_app/model/{model.pk}/change/",
            data=form.fields,
            headers={"Referer": str(page.url)},
        )
        assert saved.status_code == 200 and "was changed successfully" in saved.text, saved.text[-1500:]
    edited = time.monotonic()
    wait_until(
        lambda: all(lane_capacity(fleet.host(n).url, api_key, "tiny") == 3 for n in (1, 2)),
        timeout=5,
        interval=0.05,
        what="both hosts to apply the edit",
    )
    assert time.monotonic() - edited < 5
    # Either host's /readyz lists the whole fleet, each host's lane and the total.
    readyz = httpx.get(f"{fleet.host(1).url}/readyz", headers={"Authorization": f"Bearer {api_key}"}).json()
    assert [h["host"] for h in readyz["fleet"]["hosts"]] == ["h01", "h02"]
    assert readyz["fleet"]["total"]["capacity"] == sum(h["capacity"] for h in readyz["fleet"]["hosts"]) >= 6


def test_a_fleet_reload_rolls_host_by_host_under_traffic(
    fleet: Fleet, fleet_alias, api_key, django_user_model, tiny_eos_id
):
    """A reload of the model for the whole fleet, asked through the admin-only process while
    six clients keep sending requests through the proxy: every request is answered 200 (none
    refused as draining while a host waits for its running requests: arrivals wait in its lane,
    LANE-4), and both hosts answer /readyz 200 throughout."""
    from models_app.catalogue import control

    both_hosts_ready(fleet)
    for n in (1, 2):
        with client(fleet.host(n).url, api_key) as http:
            assert turn(http, "warm up").status_code == 200
    stop = threading.Event()
    statuses: list[int] = []
    # Long enough that each host is still running several when its reload begins.
    steady = {"max_output_tokens": 32, "logit_bias": {str(tiny_eos_id): -100}}
    readiness: list[tuple[int, int]] = []

    def traffic() -> None:
        with client(fleet.url, api_key) as http:
            while not stop.is_set():
                try:
                    statuses.append(turn(http, "Steady traffic.", **steady).status_code)
                except httpx.TransportError:
                    statuses.append(0)  # the connection dropped: as much a refusal as a 503

    def probe() -> None:
        while not stop.is_set():
            readiness.append(
                tuple(httpx.get(f"{fleet.host(n).url}/readyz", timeout=5).status_code for n in (1, 2))  # type: ignore[misc]
            )
            time.sleep(0.05)  # the probe's own period, as a balancer's check interval

    threads = [threading.Thread(target=traffic) for _ in range(CLIENTS)] + [threading.Thread(target=probe)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(statuses) >= 2 * CLIENTS, timeout=30, what="traffic to flow")
        model = fleet_alias.model
        with contextlib.closing(staff_session(fleet, django_user_model)) as admin:
            admin.get(f"/admin/models_app/model/{model.pk}/change/")
            reloaded = admin.post(
                f"/admin/models_app/model/{model.pk}/action/reload/",
                data={"csrfmiddlewaretoken": admin.cookies["csrftoken"]},
                headers={"Referer": f"{fleet.url}/admin/models_app/model/{model.pk}/change/"},
            )
            assert reloaded.status_code == 200, reloaded.text[-500:]

        def both_done() -> dict[int, dict[str, Any]] | None:
            results = {
                s["host_id"]: (s.get("actions") or {}).get(model.name) or {}
                for s in control.engine_statuses()
            }
            done = {
                h: r for h, r in results.items() if r.get("action") == "reload" and r.get("state") == "done"
            }
            return done if len(done) == 2 else None

        done = wait_until(both_done, timeout=120, interval=0.2, what="both hosts to finish the reload")
        assert done[1]["rolling_id"] == done[2]["rolling_id"] is not None
        assert done[2]["started_at"] >= done[1]["at"]  # host 2 began once host 1 had finished
        sent = len(statuses)
        wait_until(lambda: len(statuses) >= sent + 2 * CLIENTS, timeout=30, what="traffic after the reload")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    refused = [code for code in statuses if code != 200]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "fleet-reload.json").write_text(
        json.dumps({"clients": CLIENTS, "requests": len(statuses), "refused": len(refused)})
    )
    assert statuses and not refused, f"{len(refused)} of {len(statuses)} refused: {sorted(set(refused))}"
    # Each host stays ready through its reload (`reloading` serves: requests wait in its lane),
    # so HAProxy never takes it out and cuts the requests waiting there.
    assert readiness and set(readiness) == {(200, 200)}, sorted(set(readiness))


def test_a_killed_host_leaves_the_survivor_serving_and_its_chains_continue(
    fleet: Fleet, fleet_alias, api_key, tiny_eos_id
):
    """SIGKILL host 1 while 8 streams run: host 2's streams complete, requests through the proxy
    get no 5xx, host 1's chains continue on host 2 with the same greedy text, no stored row is left
    unfinished, and host 1 takes traffic again once it is back."""
    from models_app.models import StoredResponse

    both_hosts_ready(fleet)
    # Chains made on host 1, and the answer host 1 gives warm to their next turn (a branch).
    expected: dict[str, str] = {}
    with client(fleet.host(1).url, api_key) as one:
        for i in range(3):
            parent = turn(one, f"Host one keeps chain {i}.").json()["id"]
            branch = turn(one, "What comes next?", parent)
            assert branch.status_code == 200 and branch.headers["x-session-cache"] in WARM
            expected[parent] = text_of(branch.json())
    body = {**endless(tiny_eos_id), "max_output_tokens": 300}
    watches = {n: [StreamWatch(fleet.host(n).url, api_key, body) for _ in range(4)] for n in (1, 2)}
    for watch in watches[1] + watches[2]:
        assert watch.started.wait(60), watch.failure
    fleet.host(1).kill()
    for watch in watches[2]:
        watch.join(120)
        assert watch.status == "incomplete" and watch.failure is None  # ran to its token limit
    for watch in watches[1]:
        watch.join(30)
        assert watch.terminal is None  # cut off with its host
    with client(fleet.url, api_key) as http:
        after = [turn(http, f"Right after the kill {i}.") for i in range(8)]
        assert [r.status_code for r in after] == [200] * 8
        assert {home_host(r.json()["id"]) for r in after} == {2}
        for parent, text in expected.items():
            continued = turn(http, "What comes next?", parent)
            assert continued.status_code == 200, continued.text
            assert home_host(continued.json()["id"]) == 2  # replayed from the row, on the survivor
            assert text_of(continued.json()) == text
    unfinished = StoredResponse.objects.exclude(status__in=["completed", "incomplete", "failed", "cancelled"])
    assert not unfinished.exists(), list(unfinished.values_list("public_id", "status"))
    fleet.start_host(1)
    with client(fleet.url, api_key) as http:
        wait_until(
            lambda: any(home_host(turn(http, "Back?").json()["id"]) == 1 for _ in range(4)),
            timeout=30,
            interval=0.5,
            what="host 1 to take traffic again",
        )


def test_the_banners_api_key_hint_mints_a_key_the_fleet_accepts_when_pasted(fleet: Fleet, fleet_alias):
    """The banner `make fleet` prints (the bootstrap command with the fleet's environment) says
    how to mint another key; pasted as it is into a shell that has none of that environment, it
    mints a key the fleet accepts (before, `make api-key` wrote it into SQLite)."""
    manage = [sys.executable, "manage.py", "mlxhost_bootstrap", "--port", fleet.url.rsplit(":", 1)[1]]
    env = {k: v for k, v in fleet.host(1).env.items() if k != "MLXHOST_BOOTSTRAP_API_KEY"}
    banners = [
        subprocess.run(manage, cwd=ROOT, env=env, capture_output=True, text=True, check=True) for _ in "12"
    ]
    hint = re.search(r"mint another: (.+)\)$", banners[1].stdout, re.MULTILINE)
    assert hint is not None, banners[1].stdout
    # A shell with nothing of the fleet's environment; make is told the venv is installed (so
    # `make install` does not run pip here), the only difference from a paste.
    shell = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "MAKEFLAGS": "-o .venv/.installed",
    }
    pasted = subprocess.run(["bash", "-c", hint[1]], cwd=ROOT, env=shell, capture_output=True, text=True)
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr
    key = re.search(r"API key:\s+(mlxh_\S+)", pasted.stdout)
    assert key is not None, pasted.stdout
    models = httpx.get(f"{fleet.url}/v1/models", headers={"Authorization": f"Bearer {key[1]}"}, timeout=30)
    assert models.status_code == 200, models.text


def test_a_host_killed_under_the_supervisor_comes_back_while_the_other_serves(
    fleet: Fleet, fleet_alias, api_key
):
    """What `make fleet` does when a host dies (`Fleet.supervise`): SIGKILL host 1; requests
    through the proxy keep getting 200 from host 2 meanwhile, the supervisor says what happened
    and starts host 1 again, and host 1 takes traffic once it is back; the run ends 0."""
    both_hosts_ready(fleet)
    lines: list[str] = []
    stop = threading.Event()
    codes: list[int] = []
    supervisor = threading.Thread(target=lambda: codes.append(fleet.supervise(stop, lines.append)))
    supervisor.start()
    try:
        fleet.host(1).kill()
        with client(fleet.url, api_key) as http:
            meanwhile = [turn(http, f"While host one is down {i}.") for i in range(6)]
            assert [r.status_code for r in meanwhile] == [200] * 6, [r.text for r in meanwhile]
            wait_until(lambda: "fleet: h01 is back" in lines, timeout=120, interval=0.5, what="h01 back")
            wait_until(
                lambda: any(home_host(turn(http, "Back?").json()["id"]) == 1 for _ in range(4)),
                timeout=30,
                interval=0.5,
                what="host 1 to take traffic again",
            )
    finally:
        stop.set()
        supervisor.join(30)
    assert codes == [0]
    assert lines[0].startswith("fleet: h01 exited (code -9); starting it again in 1s"), lines
    assert "fleet: h01 started again" in lines and not [line for line in lines if "h02" in line]
