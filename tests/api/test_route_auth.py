"""Every HTTP route and WebSocket route refuses a caller without credentials, except a named few.

The routes are enumerated from the URLconf and api/routing.py, so a route added without auth
fails this test until it authenticates or is added to the allowlist on purpose.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient
from django.urls import URLPattern, URLResolver, get_resolver, resolve

from api.routing import websocket_urlpatterns

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# Routes meant to answer anyone, by URL name (namespace:name), each with its reason.
PUBLIC = {
    "healthz": "liveness probe; says only 'ok'",
    "readyz": "readiness probe; details only with a key or staff session",
    "openapi": "the published API schema; no secrets",
    "admin:login": "the login page itself",
    "admin:logout": "logging out needs no login",
    "unknown-route": "serves nothing: every path under /v1/ that no route serves gets a JSON 404",
}
# The root redirect to /admin/ and the favicon redirect have no name.
PUBLIC_PATHS = {"/", "/favicon.ico"}  # the favicon redirect: to a static file, nothing behind it
REFUSED = {401, 403, 405}
SAMPLE = {"int": "1", "str": "x", "slug": "x", "uuid": "00000000-0000-0000-0000-000000000000", "path": "1"}
# A named group, or a plain one such as the catch-all's `(/|$)`.
GROUP = re.compile(r"\((?:\?P<(\w+)>)?((?:[^()]|\([^()]*\))*)\)")


def _route_sample(route: str) -> str:
    return re.sub(r"<(?:(\w+):)?\w+>", lambda m: SAMPLE.get(m.group(1) or "str", "x"), route)


def _regex_sample(regex: str) -> str:
    def group(match: re.Match) -> str:
        inner = match.group(2)
        for candidate in ("x", "1", "/", *inner.split("|")):
            if re.fullmatch(inner, candidate):
                return candidate
        raise AssertionError(f"no sample value for {match.group(0)} in {regex}")

    return GROUP.sub(group, regex).lstrip("^").rstrip("$").replace("\\", "")


def _sample(pattern) -> str:
    text = str(pattern.pattern)
    return _regex_sample(text) if text.startswith("^") or "(?P<" in text else _route_sample(text)


def http_routes(patterns=None, prefix: str = "", namespace: str = "") -> Iterator[tuple[str, str, object]]:
    """(sample path, namespaced name or "", view) for every URL pattern, recursively."""
    for pattern in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(pattern, URLResolver):
            ns = f"{namespace}{pattern.namespace}:" if pattern.namespace else namespace
            yield from http_routes(pattern.url_patterns, prefix + _sample(pattern), ns)
        elif isinstance(pattern, URLPattern):
            name = f"{namespace}{pattern.name}" if pattern.name else ""
            yield "/" + prefix + _sample(pattern), name, pattern.callback


def _answered(response) -> bool:
    to_login = response.status_code == 302 and "/admin/login/" in response.headers.get("Location", "")
    return response.status_code not in REFUSED and not to_login


async def test_every_http_route_refuses_a_caller_without_credentials(settings):
    """API-5 (issue 10, "Prove it"): GET and POST on every URL pattern, with no key and with a
    wrong one, answer 401/403/405 or redirect to the login, unless the route is in PUBLIC."""
    settings.MLXHOST_METRICS_PUBLIC = False
    routes = list(http_routes())
    assert len(routes) > 30  # the admin's patterns are in, not only the API's
    client = AsyncClient()
    answered = []
    for path, name, view in routes:
        assert resolve(path).func is view, path  # the sample really reaches this pattern
        if name in PUBLIC or path in PUBLIC_PATHS:
            continue
        for method in ("get", "post"):
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                response = await getattr(client, method)(path, headers=headers)
                if _answered(response):
                    answered.append(f"{method.upper()} {path} ({name}) {headers}: {response.status_code}")
    assert not answered, "routes answering without credentials:\n" + "\n".join(answered)


@pytest.mark.parametrize("route", websocket_urlpatterns, ids=lambda r: str(r.pattern))
async def test_every_socket_route_refuses_a_caller_without_credentials(route):
    """API-5: each Channels route closes a handshake with no key, a wrong key, or (for the
    Responses socket's first-frame auth) a first frame that is not a valid key."""
    from mlxhost.asgi import application

    path = "/" + _route_sample(str(route.pattern))
    # The catch-all route (a path nothing serves) refuses everyone with 4404 (issue 25).
    refusals = (4404,) if str(route.pattern) == "" else (4401, 4403)
    for headers in ([], [(b"authorization", b"Bearer sk-wrong")]):
        socket = WebsocketCommunicator(application, path, headers=[(b"host", b"testserver"), *headers])
        connected, code = await socket.connect(timeout=10)
        assert not connected and code in refusals, (path, headers, connected, code)
    socket = WebsocketCommunicator(
        application, path + "?auth=first-frame", headers=[(b"host", b"testserver")]
    )
    connected, code = await socket.connect(timeout=10)
    if connected:  # first-frame auth: anything but a valid key is refused
        await socket.send_to(text_data='{"type": "auth", "api_key": "sk-wrong"}')
        closed = await socket.receive_output(timeout=10)
        if closed["type"] == "websocket.send":
            closed = await socket.receive_output(timeout=10)
        assert closed == {"type": "websocket.close", "code": 4401}, closed
    await socket.disconnect()
