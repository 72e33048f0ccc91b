"""Hostile input generated from /v1/openapi.json, in the default suite: no 5xx and no body that is
not JSON (or, for a stream, SSE of JSON events) on any operation (issue 25, "Prove it").

schemathesis draws the cases from the published schema, valid for it (positive) and not
(negative); they are sent in-process through the ASGI app, on the real tiny model. The chaos
suite (tests/e2e/test_schemathesis.py) runs the same checks against a real daphne with more cases.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from typing import Any
from urllib.parse import urlencode

import pytest
import schemathesis
from django.test import AsyncClient
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.core import NotSet

from api.openapi import openapi_schema
from tests.api.support import body_problem
from tests.support import register_alias

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]

EXAMPLES = 30  # per operation and mode; the chaos suite runs 100 against daphne


def drawn(operation: Any, mode: GenerationMode) -> list[Any]:
    """Up to EXAMPLES cases of `operation`, drawn before any is sent (hypothesis runs sync)."""
    cases: list[Any] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def collect(case: Any) -> None:
        cases.append(case)

    collect()
    return cases


@pytest.fixture
def fuzz_aliases(tiny_model_dir, minilm_folder):
    register_alias(name="minilm", folder="all-minilm-l6-v2", concurrency=4)
    return register_alias(name="tiny", folder="tiny-llama", max_tokens=1, max_output_tokens=1)


def even(text: str) -> bool:
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % 2 == 0


async def send(client: AsyncClient, case: Any, api_key: str, stored_id: str) -> tuple[int, str | None]:
    """Send one drawn case with a valid key; (its status, what is wrong with the answer or None)."""
    body = None if isinstance(case.body, NotSet) else case.body
    # Half the reads name a stored response, so their query parameters are reached too.
    drawn_id = (case.path_parameters or {}).get("public_id")
    if case.method == "GET" and isinstance(drawn_id, str) and even(drawn_id):
        case.path_parameters["public_id"] = stored_id
    # Half the bodies name a real model (by a hash of the drawn name), so generation and the
    # engine's checks are reached, not only the 404 for an unknown model.
    named = isinstance(body, dict) and isinstance(body.get("model"), str)
    if named and even(body["model"]):
        body["model"] = "minilm" if case.path == "/v1/embeddings" else "tiny"
    query = f"?{urlencode(case.query, doseq=True)}" if case.query else ""
    kwargs: dict[str, Any] = {"headers": {"Authorization": f"Bearer {api_key}"}}
    if body is not None:  # negative cases may be bytes that are not JSON at all
        data = body if isinstance(body, bytes) else json.dumps(body)
        kwargs |= {"data": data, "content_type": "application/json"}
    response = await client.generic(case.method, case.formatted_path + query, **kwargs)
    content = (
        b"".join([chunk async for chunk in response.streaming_content])
        if response.streaming
        else response.content
    )
    if response.status_code >= 500:
        return response.status_code, f"status {response.status_code}: {content[:300]!r}"
    return response.status_code, body_problem(response.status_code, response.get("Content-Type"), content)


async def test_no_generated_request_gets_a_5xx_or_a_body_that_is_not_json(fuzz_aliases, api_key, mlx_engine):
    """API-4: every operation of the schema, cases valid and not, with a valid key."""
    schema = schemathesis.openapi.from_dict(openapi_schema())
    client = AsyncClient()
    stored = await client.post(
        "/v1/responses",
        data=json.dumps({"model": "tiny", "input": [{"role": "user", "content": "hi"}]}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_key}"},
    )
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for mode in GenerationMode:
            for case in drawn(operation, mode):
                status, problem = await send(client, case, api_key, stored.json()["id"])
                statuses[status] += 1
                if problem:
                    failures.append(f"{case.method} {case.formatted_path} {case.body!r:.300}: {problem}")
    assert len(operations) == len(openapi_schema()["paths"]) + 1  # /v1/responses/{id}: GET, DELETE
    assert sum(statuses.values()) > 10 * len(operations)
    assert statuses[200] > 0 and statuses[400] > 0, statuses  # generation and refusals both reached
    assert not failures, "\n".join(failures)
