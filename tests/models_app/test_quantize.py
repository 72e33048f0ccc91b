"""Quantized copies (issue 28, item 2): the Celery task makes, measures and registers a copy; failures
leave no half-registered Model and no folder; the admin's action, form page, list and panel."""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.template.defaultfilters import filesizeformat

from mlxhost.engine import folder_fingerprint
from mlxhost.engine.backends.mlx import quantize as engine_quantize
from models_app.catalogue import quantize, quantize_job
from models_app.catalogue.tasks import model_quantize
from models_app.models import Model, QuantizedCopy
from tests.support import register_alias, wait_until

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status"), pytest.mark.timeout(120)]

MODELS_URL = "/admin/models_app/model/"
COPIES_URL = "/admin/models_app/quantizedcopy/"


@pytest.fixture
def models_root(tmp_path, settings, tiny_model_dir) -> Path:
    """A MODELS_ROOT of this test's own, holding the tiny model: copies made here start from nothing."""
    settings.MODELS_ROOT = tmp_path
    shutil.copytree(tiny_model_dir, tmp_path / "tiny-llama")
    return tmp_path


@pytest.fixture
def tiny(models_root) -> Model:
    return register_alias(name="tiny", folder="tiny-llama", concurrency=4).model


@pytest.fixture
def dispatched(monkeypatch) -> list[int]:
    """The copies handed to the task on commit (recorded here instead of run)."""
    ids: list[int] = []
    monkeypatch.setattr(quantize, "quantized_copy_dispatch", lambda *, copy_id: ids.append(copy_id))
    return ids


@pytest.fixture
def stages(monkeypatch) -> list[str]:
    """Every stage the task wrote to the row, in order."""
    seen: list[str] = []
    real = quantize_job._set

    def record(copy, **fields):
        if "stage" in fields:
            seen.append(fields["stage"])
        real(copy, **fields)

    monkeypatch.setattr(quantize_job, "_set", record)
    return seen


def run(copy: QuantizedCopy) -> QuantizedCopy:
    model_quantize.apply(args=[copy.pk], throw=True)  # eager, its argument round-tripped as a broker would
    copy.refresh_from_db()
    return copy


def leftovers(root: Path) -> list[str]:
    folder = root / quantize_job.QUANTIZED_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_the_task_makes_measures_and_registers_a_copy(
    tiny, models_root, stages, django_capture_on_commit_callbacks, dispatched
):
    """The copy is mlx-lm's 4-bit form in the managed folder, registered as a new local Model with its
    own fingerprint and the original's lane; both sides are measured; a second run changes nothing."""
    with django_capture_on_commit_callbacks(execute=True):
        copy = quantize.quantized_copy_request(model=tiny, bits=4, group_size=32)
    assert dispatched == [copy.pk] and copy.status == QuantizedCopy.Status.QUEUED

    copy = run(copy)
    assert copy.status == QuantizedCopy.Status.DONE, copy.error
    assert stages == ["", "loading", "quantizing", "saving", "measuring", "registering", ""]
    made = copy.result
    assert (made.name, made.local_path, made.kind, made.concurrency) == (
        "tiny-4bit-g32",
        "quantized/tiny-4bit-g32",
        Model.Kind.CHAT,
        4,
    )
    folder = models_root / made.local_path
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    assert made.instance.fingerprint == folder_fingerprint(folder) != tiny.instance.fingerprint
    assert copy.source_bytes == engine_quantize.weights_bytes(models_root / "tiny-llama")
    assert copy.copy_bytes == engine_quantize.weights_bytes(folder) < copy.source_bytes / 2
    assert copy.source_load_s > 0 and copy.copy_load_s > 0
    assert copy.source_tokens_per_s > 0 and copy.copy_tokens_per_s > 0
    assert copy.quantized_layers == 15  # 7 linear layers in each of 2 blocks, and the embedding

    run(copy)  # a redelivered task: the same end state
    assert Model.objects.count() == 2 and QuantizedCopy.objects.get().result == made
    assert leftovers(models_root) == ["tiny-4bit-g32"]


def test_a_task_redelivered_after_the_save_reuses_the_folder(tiny, models_root, stages, dispatched):
    """A worker killed between saving and registering (acks_late: the task comes again): the second
    run finds the copy built from the same original and settings, measures and registers it."""
    copy = run(quantize.quantized_copy_request(model=tiny, bits=4, group_size=64))
    built = (models_root / copy.folder / "model.safetensors").stat().st_mtime_ns
    copy.result.delete()  # registering commits with the row's `done`: a kill before it leaves neither
    QuantizedCopy.objects.filter(pk=copy.pk).update(status="running", stage="saving")
    stages.clear()
    again = run(copy)
    assert again.status == QuantizedCopy.Status.DONE, again.error
    assert stages == ["", "loading", "measuring", "registering", ""]
    assert (models_root / copy.folder / "model.safetensors").stat().st_mtime_ns == built
    assert again.result.local_path == copy.folder and again.quantized_layers == copy.quantized_layers


def test_a_second_copy_with_the_same_settings_waits_for_the_first(tiny, dispatched, celery_publishes):
    """With a broker: the first copy is the worker's (redelivered if it dies), so a second waits."""
    quantize.quantized_copy_request(model=tiny, bits=8, group_size=64)
    with pytest.raises(ValidationError, match="already being made"):
        quantize.quantized_copy_request(model=tiny, bits=8, group_size=64)
    quantize.quantized_copy_request(model=tiny, bits=8, group_size=128)  # another setting is another copy


def test_without_a_broker_a_copy_whose_thread_is_gone_was_interrupted(tiny, dispatched):
    """Eager mode: a row still in flight with no thread running it (the process restarted) is failed
    as interrupted when the same copy is asked for again, and the new request goes ahead."""
    old = quantize.quantized_copy_request(model=tiny, bits=8, group_size=64)
    new = quantize.quantized_copy_request(model=tiny, bits=8, group_size=64)
    old.refresh_from_db()
    assert (old.status, old.error) == (QuantizedCopy.Status.FAILED, quantize.INTERRUPTED)
    assert new.status == QuantizedCopy.Status.QUEUED


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param(
            {"source_kind": "hub", "hf_repo": "a/b", "hf_revision": "main"}, quantize.ONLY_LOCAL, id="hub"
        ),
        pytest.param({"kind": "embedding"}, quantize.ONLY_CHAT, id="embedding"),
    ],
)
def test_only_local_chat_models_are_offered(tiny, dispatched, fields, message):
    Model.objects.filter(pk=tiny.pk).update(**fields)
    tiny.refresh_from_db()
    with pytest.raises(ValidationError, match=re.escape(message)):
        quantize.quantized_copy_request(model=tiny, bits=4, group_size=64)
    assert not QuantizedCopy.objects.exists()


def test_quantized_weights_are_refused_with_a_clear_message(tiny, models_root, dispatched):
    """A model that is quantized already fails at once: no new Model, no folder."""
    first = run(quantize.quantized_copy_request(model=tiny, bits=4, group_size=32))
    again = run(quantize.quantized_copy_request(model=first.result, bits=8, group_size=64))
    assert again.status == QuantizedCopy.Status.FAILED
    assert again.error == "These weights are quantized already; quantize the full-precision model."
    assert again.result is None and Model.objects.count() == 2
    assert leftovers(models_root) == ["tiny-4bit-g32"]


def test_a_full_disk_is_named_before_anything_is_written(tiny, models_root, dispatched, monkeypatch, stages):
    monkeypatch.setattr(
        engine_quantize.shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(10**9, 10**9, 1000)
    )
    copy = run(quantize.quantized_copy_request(model=tiny, bits=8, group_size=64))
    assert copy.status == QuantizedCopy.Status.FAILED
    assert copy.error.startswith("Not enough free disk space in ") and "0.0 MB are free" in copy.error
    assert "loading" not in stages
    assert Model.objects.count() == 1 and leftovers(models_root) == []


def test_a_disk_that_fills_up_while_saving_leaves_nothing(tiny, models_root, dispatched, monkeypatch):
    """ENOSPC halfway through the write: the temporary folder goes, no Model is registered."""

    def save(folder, *_args):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine_quantize, "save", save)
    copy = run(quantize.quantized_copy_request(model=tiny, bits=4, group_size=64))
    assert copy.status == QuantizedCopy.Status.FAILED and copy.error.startswith("Not enough free disk space")
    assert Model.objects.count() == 1
    assert (
        sorted(p.name for p in (models_root / quantize_job.QUANTIZED_DIR).iterdir()) == []
    )  # no temp sibling


def test_a_copy_that_cannot_be_registered_leaves_no_model_and_no_folder(
    tiny, models_root, dispatched, monkeypatch
):
    def refuse(*, model, actor=None):
        raise ValidationError({"local_path": "refused for the test"})

    monkeypatch.setattr(quantize_job.services, "model_save", refuse)
    copy = run(quantize.quantized_copy_request(model=tiny, bits=4, group_size=64))
    assert copy.status == QuantizedCopy.Status.FAILED
    assert copy.error == "The copy could not be registered: refused for the test"
    assert Model.objects.count() == 1 and leftovers(models_root) == []


def test_an_architecture_mlx_lm_does_not_know_fails_clearly(tiny, models_root, dispatched):
    config_path = models_root / "tiny-llama" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "model_type": "no-such-arch"}))
    copy = run(quantize.quantized_copy_request(model=tiny, bits=4, group_size=64))
    assert copy.status == QuantizedCopy.Status.FAILED
    assert copy.error.startswith("mlx-lm cannot load this model: ")
    assert Model.objects.count() == 1 and leftovers(models_root) == []


# The admin ------------------------------------------------------------------------------------------


def test_the_action_asks_for_the_settings_then_queues_the_copy(
    admin_client, tiny, dispatched, django_capture_on_commit_callbacks
):
    response = admin_client.post(MODELS_URL, {"action": "make_quantized_copy", "_selected_action": [tiny.pk]})
    assert response.status_code == 302 and response["Location"] == f"{MODELS_URL}quantize/?ids={tiny.pk}"
    form = admin_client.get(response["Location"]).content.decode()
    assert 'name="bits"' in form and 'name="group_size"' in form and "<strong>tiny</strong>" in form

    with django_capture_on_commit_callbacks(execute=True):
        posted = admin_client.post(
            f"{MODELS_URL}quantize/", {"ids": str(tiny.pk), "bits": "8", "group_size": "64"}
        )
    assert posted.status_code == 302 and posted["Location"] == COPIES_URL
    copy = QuantizedCopy.objects.get()
    assert (copy.bits, copy.group_size, dispatched) == (8, 64, [copy.pk])
    shown = admin_client.get(COPIES_URL).content.decode()
    assert "Quantized copy requested for tiny" in shown and "Queued" in shown


def test_bad_settings_are_refused_on_the_form(admin_client, tiny, dispatched):
    page = admin_client.post(f"{MODELS_URL}quantize/", {"ids": str(tiny.pk), "bits": "3", "group_size": "64"})
    assert page.status_code == 200 and "Select a valid choice" in page.content.decode()
    assert not QuantizedCopy.objects.exists()


def test_the_list_shows_each_stage_and_why_a_copy_failed(admin_client, tiny):
    QuantizedCopy.objects.create(
        source=tiny, bits=4, group_size=64, folder="quantized/x", status="running", stage="quantizing"
    )
    QuantizedCopy.objects.create(
        source=tiny, bits=8, group_size=64, folder="quantized/y", status="failed", error="Disk full."
    )
    page = admin_client.get(COPIES_URL).content.decode()
    assert "Running: quantizing" in page and "Failed: Disk full." in page
    running = QuantizedCopy.objects.get(bits=4)
    assert admin_client.get(f"{COPIES_URL}{running.pk}/change/").status_code == 200  # read-only
    assert admin_client.get(f"{COPIES_URL}add/").status_code == 403


def test_the_model_pages_show_the_copy_beside_the_original(admin_client, tiny, dispatched):
    copy = run(quantize.quantized_copy_request(model=tiny, bits=4, group_size=32))
    for model in (tiny, copy.result):
        page = admin_client.get(f"{MODELS_URL}{model.pk}/change/").content.decode()
        assert "Quantized copies" in page and "tiny (original)" in page
        assert (
            f"{copy.copy_tokens_per_s:.1f} tok/s" in page and f"{copy.source_tokens_per_s:.1f} tok/s" in page
        )
        assert f"({copy.copy_bytes / copy.source_bytes:.0%})" in page
    assert (
        f"{MODELS_URL}quantize/?ids={tiny.pk}"
        in admin_client.get(f"{MODELS_URL}{tiny.pk}/change/").content.decode()
    )
    listing = admin_client.get(COPIES_URL).content.decode()
    assert "tiny-4bit-g32" in listing
    assert f"{filesizeformat(copy.source_bytes)} → {filesizeformat(copy.copy_bytes)}" in listing


def test_the_action_needs_the_add_permission(client, django_user_model, tiny):
    staff = django_user_model.objects.create_user(username="viewer", password="pw-viewer-123", is_staff=True)
    client.force_login(staff)
    assert client.get(f"{MODELS_URL}quantize/?ids={tiny.pk}").status_code == 403


@pytest.mark.django_db(transaction=True)
def test_without_a_broker_the_copy_runs_in_a_thread_of_its_own(tiny, models_root):
    """Eager mode (no REDIS_URL): the request returns at once, a thread runs the task to the end."""
    copy = quantize.quantized_copy_request(model=tiny, bits=8, group_size=64)  # autocommit: dispatched now
    done = wait_until(
        lambda: QuantizedCopy.objects.filter(pk=copy.pk, status__in=["done", "failed"]).first(), timeout=60
    )
    assert done.status == QuantizedCopy.Status.DONE, done.error
    assert done.result.local_path == "quantized/tiny-8bit-g64"


def test_a_served_copy_shows_its_instance_s_own_rate(admin_client, tiny, dispatched):
    """ "Or from the instance's stats when served": the panel adds each resident instance's tokens/s."""
    from tests.models_app.test_admin import _publish, _view

    copy = run(quantize.quantized_copy_request(model=tiny, bits=4, group_size=32))
    url = f"{MODELS_URL}{tiny.pk}/change/"
    assert "42.5 tok/s" not in admin_client.get(url).content.decode()
    _publish(_view(copy.result.instance_id, aliases=[], tokens_per_s=42.5))
    page = admin_client.get(url).content.decode()
    assert "<td>42.5 tok/s</td>" in page
