"""Chaos: schemathesis fuzzes every operation of /v1/openapi.json against a real daphne; no 5xx,
and no body that is not JSON (tests/api/test_openapi_fuzz.py is its in-process, default-suite twin).

Driven through hypothesis directly: schemathesis' pytest plugin (4.32) reads a private pytest
attribute that pytest 9 no longer has (`Function._nodeid`).
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.api.support import body_problem
from tests.support import register_alias

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True), pytest.mark.timeout(1200)]

EXAMPLES_PER_OPERATION = 100
# The alias caps every generation, so a fuzzed `stream: true` or huge max_tokens stays short.
OUTPUT_CAP = 8


@pytest.fixture
def fuzz_alias(tiny_model_dir, minilm_folder):
    # The embeddings operation is fuzzed against the demo embedding model (API-14).
    register_alias(name="minilm", folder="all-minilm-l6-v2", concurrency=4)
    return register_alias(
        name="tiny",
        folder="tiny-llama",
        max_tokens=OUTPUT_CAP,
        max_output_tokens=OUTPUT_CAP,
    )


def _even(name: str) -> bool:
    return zlib.crc32(name.encode("utf-8", "surrogatepass")) % 2 == 0


def fuzz(
    operation, mode: GenerationMode, headers: dict[str, str], statuses: Counter
) -> tuple[int, list[str]]:
    """Run `operation` with cases valid (positive) or not (negative) for its schema; returns
    (examples run, server errors seen) and counts the statuses."""
    ran, errors = 0, []

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        # No shrinking: each 5xx is reported as generated, and the run stays within CI's budget.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        nonlocal ran
        ran += 1
        body = case.body
        # Half the bodies name the real model (by a hash of the generated name), so generation
        # and the engine's sampling checks are reached, not only the 404 for an unknown model.
        if isinstance(body, dict) and isinstance(body.get("model"), str) and _even(body["model"]):
            body["model"] = "minilm" if case.path == "/v1/embeddings" else "tiny"
        try:
            response = case.call(headers=headers, timeout=120)
            statuses[response.status_code] += 1
            case.validate_response(response, checks=[not_a_server_error])
            content_type = (response.headers.get("content-type") or [None])[0]  # name -> values
            problem = body_problem(response.status_code, content_type, response.content)
            assert problem is None, problem  # API-4: every answer is JSON, or SSE of JSON
        except Exception as exc:  # collected, so one run reports every operation's failures
            errors.append(f"{case.method} {case.formatted_path} body={body!r:.300}: {exc!s:.600}")

    run()
    return ran, errors


def test_no_operation_answers_a_server_error(daphne_server, fuzz_alias, api_key):
    """API-4 (issue 10, "Prove it"): for every operation in the published schema, generated
    bodies, paths and parameters, sent with a valid key, never get a 5xx. The schema is fetched
    without a key: it is public, like /healthz."""
    schema = schemathesis.openapi.from_url(f"{daphne_server.url}/v1/openapi.json")
    headers = {"Authorization": f"Bearer {api_key}"}
    report, failures, statuses = {}, [], Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            ran, errors = fuzz(operation, mode, headers, statuses)
            report[f"{operation.label} ({mode.value})"] = ran
            failures += errors
            if operation.body and mode is GenerationMode.POSITIVE:  # far more than 100 distinct cases
                assert ran >= EXAMPLES_PER_OPERATION, (operation.label, ran)
    logger.warning("schemathesis: examples %s; statuses %s", report, dict(statuses))
    assert len(report) >= 20, report
    assert statuses[200] > 0, statuses  # the fuzzing reached real generations, not only refusals
    assert not failures, "\n".join(failures)
