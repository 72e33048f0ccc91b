"""A quantized copy made by a real Celery worker process (issue 28, item 2): the task published to
Redis, run by `mlxhost.celery`'s worker against the test database and its own MODELS_ROOT."""

from __future__ import annotations

import json
import shutil

import pytest

from models_app.catalogue import quantize
from models_app.catalogue.tasks import model_quantize
from models_app.models import Model, QuantizedCopy
from tests.models_app.support import off_loop
from tests.support import eventually, register_alias

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.celery, pytest.mark.timeout(180)]


@off_loop
def request_copy(models_root) -> int:
    model = register_alias(name="tiny", folder="tiny-llama").model
    return quantize.quantized_copy_request(model=model, bits=8, group_size=64).pk


@off_loop
def finished(copy_id: int) -> QuantizedCopy | None:
    return (
        QuantizedCopy.objects.select_related("result")
        .filter(pk=copy_id, status__in=["done", "failed"])
        .first()
    )


async def test_a_worker_makes_and_registers_the_copy(
    workers, queue, redis_url, celery_publishes, tiny_model_dir, tmp_path, settings, monkeypatch
):
    models_root = tmp_path / "models"
    shutil.copytree(tiny_model_dir, models_root / "tiny-llama")
    settings.MODELS_ROOT = models_root
    published: list[int] = []

    def publish(*, copy_id: int) -> None:  # to this test's queue on the worker's Redis
        with model_quantize.app.connection_for_write(redis_url) as connection:
            model_quantize.apply_async(args=[copy_id], queue=queue, connection=connection)
        published.append(copy_id)

    monkeypatch.setattr(quantize, "quantized_copy_dispatch", publish)
    worker = await workers.start(MODELS_ROOT=str(models_root))
    copy_id = await request_copy(models_root)
    assert published == [copy_id]

    copy = await eventually(lambda: finished(copy_id), timeout=120, interval=0.2)
    assert copy.status == QuantizedCopy.Status.DONE, f"{copy.error}\n{worker.output()}"
    assert copy.result.local_path == "quantized/tiny-8bit-g64"
    assert json.loads((models_root / copy.result.local_path / "config.json").read_text())["quantization"] == {
        "bits": 8,
        "group_size": 64,
        "mode": "affine",
    }
    assert copy.copy_tokens_per_s > 0 and copy.copy_bytes < copy.source_bytes
    assert await off_loop(Model.objects.count)() == 2
