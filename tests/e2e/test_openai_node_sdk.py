"""End to end: the OpenAI Node SDK (JSON.parse on every body and chunk) against a real daphne, with
logprobs under a grammar: a json_schema, a forced tool and a schema with a regex pattern (issue 25:
masked tokens filled `top_logprobs` with -Infinity, which is not JSON, and the SDK failed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

PREFIX = ROOT / ".cache" / "openai-node"
CASES = {(case, how) for case in ("json_schema", "forced_tool", "pattern") for how in ("whole", "streamed")}


def node_sdk(server_url: str, api_key: str) -> list[dict]:
    if shutil.which("node") is None:
        # CI has Node.js (the agent suite needs it too): there a missing one fails, never skips.
        if os.environ.get("MLXHOST_REQUIRE_SERVICES") == "1":
            pytest.fail("Node.js is not installed; CI needs it for the OpenAI Node SDK")
        pytest.skip("Node.js is not installed")
    subprocess.run(["bash", str(ROOT / "scripts" / "openai_node.sh")], check=True, timeout=300)
    done = subprocess.run(
        ["node", str(ROOT / "tests" / "e2e" / "js" / "logprobs.mjs"), f"{server_url}/v1", api_key, "tiny"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OPENAI_NODE_PREFIX": str(PREFIX)},
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_logprobs_under_a_grammar_parse_in_the_openai_node_sdk(daphne_server, api_key, tiny_alias):
    results = node_sdk(daphne_server.url, api_key)
    assert {(r["case"], r["how"]) for r in results} == CASES
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed  # JSON.parse refused a body or chunk, or the server answered an error
    for result in results:
        assert result["finite"], result  # every logprob and alternative is a finite number
        assert all(1 <= n <= 20 for n in result["alternatives"]), result
        if result["case"] != "forced_tool":  # a call's tokens carry none, as OpenAI's
            assert result["tokens"] > 0
            assert result["joined"] == result["text"]  # the tokens spell the text exactly
        if result["case"] == "json_schema":
            person = json.loads(result["text"])
            assert set(person) == {"name", "age"} and 0 <= person["age"] <= 99
        elif result["case"] == "pattern":
            assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", json.loads(result["text"])["code"])
        else:
            assert set(json.loads(result["arguments"])) == {"city"}
