"""A wrong method on any /v1 route is a JSON 405 with an `Allow` header (RFC 9110 §15.5.6)."""

from __future__ import annotations

import pytest
from django.test import AsyncClient

from api.openapi import openapi_schema

pytestmark = [pytest.mark.django_db]

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
PATH_VALUES = {"{public_id}": "resp_abc", "{name}": "tiny"}


def routes() -> dict[str, set[str]]:
    """Every /v1 route with the methods it serves, as the published schema documents them."""
    documented = {
        path: {method.upper() for method in operations}
        for path, operations in openapi_schema()["paths"].items()
    }
    return {**documented, "/v1/openapi.json": {"GET", "HEAD"}}


def concrete(path: str) -> str:
    for placeholder, value in PATH_VALUES.items():
        path = path.replace(placeholder, value)
    return path


def allowed(response) -> set[str]:
    return {method.strip() for method in response["Allow"].split(",")}


CASES = [
    pytest.param(path, method, served, id=f"{method}-{path}")
    for path, served in routes().items()
    for method in METHODS
    if method not in served
]


def test_every_route_has_a_wrong_method_to_try():
    assert len(routes()) >= 11
    assert {path for path, _, _ in (case.values for case in CASES)} == set(routes())


@pytest.mark.parametrize(("path", "method", "served"), CASES)
async def test_a_wrong_method_is_a_405_that_says_which_methods_are_allowed(path, method, served, api_key):
    """API-4: the surface's envelope, and `Allow` lists exactly the route's methods."""
    headers = {"Authorization": f"Bearer {api_key}"}
    response = await AsyncClient().generic(method, concrete(path), headers=headers)
    assert response.status_code == 405
    assert response["Content-Type"] == "application/json"
    body = response.json()
    message = body["error"]["message"]
    assert message == f"Method {method} is not allowed here."
    assert allowed(response) == served


@pytest.mark.parametrize("path", list(routes()))
async def test_a_preflight_from_an_origin_that_is_not_allowed_is_a_405_with_allow(path, settings):
    """CORS: the middleware answers only allowed origins (api/cors.py); any other preflight
    reaches the route and gets its 405, with `Allow` and no Access-Control-* header."""
    settings.MLXHOST_CORS_ORIGINS = ["https://app.example"]
    headers = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    response = await AsyncClient().options(concrete(path), headers=headers)
    assert response.status_code == 405
    assert allowed(response) == routes()[path]
    assert not [name for name in response.headers if name.lower().startswith("access-control-")]
