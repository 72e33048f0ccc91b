"""The Model/Alias split migration on a database with rows: nothing is lost, both ways (issue 11)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = [pytest.mark.django_db(transaction=True)]

BEFORE = [("models_app", "0002_instancetombstone")]
AFTER = [("models_app", "0003_model_alias_split")]


def _migrate(target):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(target)
    return executor.loader.project_state(target).apps


@pytest.fixture
def old_apps():
    apps = _migrate(BEFORE)
    yield apps
    _migrate(executor_leaf())


def executor_leaf():
    return MigrationExecutor(connection).loader.graph.leaf_nodes("models_app")


def _old_alias(apps, name, instance, **fields):
    Alias = apps.get_model("models_app", "ModelAlias")
    defaults = {
        "source_kind": "local",
        "local_path": instance.source,
        "instance": instance,
        "concurrency": 1,
        "queue_depth": 16,
        "keep_alive_s": 1800,
        "temperature": 0.7,
    }
    return Alias.objects.create(name=name, **{**defaults, **fields})


def test_aliases_of_the_same_weights_become_one_model_and_keep_their_own_settings(old_apps):
    Instance = old_apps.get_model("models_app", "ModelInstance")
    shared = Instance.objects.create(source_kind="local", source="smol", fingerprint="a" * 64)
    other = Instance.objects.create(source_kind="local", source="qwen", fingerprint="b" * 64)
    _old_alias(old_apps, "smollm2", shared, concurrency=1, temperature=0.0, pinned=True, max_tokens=64)
    _old_alias(old_apps, "smol-batch", shared, concurrency=8, keep_alive_s=None, temperature=0.9)
    _old_alias(old_apps, "qwen", other, source_kind="local", concurrency=2, queue_timeout_s=5.0)

    apps = _migrate(AFTER)
    Model = apps.get_model("models_app", "Model")
    Alias = apps.get_model("models_app", "ModelAlias")
    assert Model.objects.count() == 2
    smol = Model.objects.get(local_path="smol")
    # The most generous lane and memory settings win, and the description says what each alias had.
    assert (smol.instance_id, smol.concurrency, smol.keep_alive_s, smol.pinned) == (shared.pk, 8, None, True)
    assert "smollm2: pinned=True, keep_alive_s=1800, concurrency=1" in smol.description
    assert "smol-batch: pinned=False, keep_alive_s=None, concurrency=8" in smol.description
    qwen = Model.objects.get(local_path="qwen")
    assert (qwen.name, qwen.concurrency, qwen.queue_timeout_s) == ("qwen", 2, 5.0)
    # Each alias keeps its own sampling and limits, and points at its weights' model.
    rows = {a.name: (a.model_id, a.temperature, a.max_tokens) for a in Alias.objects.all()}
    assert rows == {
        "smollm2": (smol.pk, 0.0, 64),
        "smol-batch": (smol.pk, 0.9, 512),
        "qwen": (qwen.pk, 0.7, 512),
    }

    back = _migrate(BEFORE)
    OldAlias = back.get_model("models_app", "ModelAlias")
    restored = {a.name: (a.local_path, a.instance_id, a.concurrency) for a in OldAlias.objects.all()}
    assert restored == {
        "smollm2": ("smol", shared.pk, 8),
        "smol-batch": ("smol", shared.pk, 8),
        "qwen": ("qwen", other.pk, 2),
    }


def test_an_empty_database_migrates_both_ways(old_apps):
    apps = _migrate(AFTER)
    assert apps.get_model("models_app", "Model").objects.count() == 0
    _migrate(BEFORE)
