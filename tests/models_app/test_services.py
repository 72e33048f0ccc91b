"""Services: API keys are hashed, aliases bind to instances by weights, folders are vetted."""

from __future__ import annotations

import io
import json
import shutil
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from models_app.catalogue import selectors, services, specs
from models_app.models import ApiKey, ModelAlias, ModelInstance, StoredResponse

pytestmark = [pytest.mark.django_db]


def test_api_key_secret_is_never_stored_in_plaintext(user):
    """API-5: API keys are stored hashed; the table holds no secret."""
    key, raw = services.apikey_create(owner=user, name="ci")
    secret = raw.split("_", 2)[2]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ApiKey._meta.db_table}")
        rows = cursor.fetchall()
    dump = json.dumps(rows, default=str)
    assert secret not in dump
    assert raw not in dump
    assert key.prefix in dump  # the lookup prefix is the only readable part
    assert selectors.apikey_authenticate(raw_key=raw) == key


def test_bootstrap_key_from_environment_is_hashed_and_idempotent(user):
    raw = "my-fixed-automation-key-0123456789"
    first = services.apikey_ensure(owner=user, raw_key=raw, name="bootstrap")
    second = services.apikey_ensure(owner=user, raw_key=raw, name="bootstrap")
    assert first.pk == second.pk
    assert ApiKey.objects.count() == 1
    assert raw not in json.dumps(list(ApiKey.objects.values()), default=str)
    assert selectors.apikey_authenticate(raw_key=raw) == first


def test_short_bootstrap_key_is_refused(user):
    with pytest.raises(ValidationError):
        services.apikey_ensure(owner=user, raw_key="short", name="bootstrap")


def test_inactive_owner_cannot_authenticate(user):
    _, raw = services.apikey_create(owner=user, name="x")
    user.is_active = False
    user.save()
    assert selectors.apikey_authenticate(raw_key=raw) is None


def test_two_aliases_of_the_same_weights_share_one_instance(tiny_model_dir):
    """REG-2: aliases naming the same weights share one instance id."""
    a = services.alias_register(name="a", source_kind="local", local_path="tiny-llama")
    b = services.alias_register(name="b", source_kind="local", local_path="./tiny-llama/")
    assert a.instance_id == b.instance_id
    assert ModelInstance.objects.count() == 1
    assert specs.model_spec_for(alias=a) == specs.model_spec_for(alias=b)


def test_changed_weights_get_a_new_monotonic_instance_id(tiny_model_dir, settings):
    """REG-3: an instance is a registration of specific weights; new weights get a new, larger id."""
    copy = tiny_model_dir.parent / "tiny-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(tiny_model_dir, copy)
    try:
        first = services.alias_register(name="c", source_kind="local", local_path="tiny-copy")
        config = json.loads((copy / "config.json").read_text())
        config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
        (copy / "config.json").write_text(json.dumps(config))
        second = services.alias_register(name="c", source_kind="local", local_path="tiny-copy")
        assert second.instance_id > first.instance_id
        assert second.instance.fingerprint != ModelInstance.objects.get(pk=first.instance_id).fingerprint
    finally:
        shutil.rmtree(copy)


def test_a_hub_alias_is_pinned_to_the_commit_its_revision_names(fake_hub):
    """Issue 28: the spec names the commit, resolved at save (empty revision: main)."""
    repo = "mlx-community/SmolLM2-135M-Instruct"
    sha = fake_hub.commit(repo, {"config.json": b"{}"})
    alias = services.alias_register(name="hub", source_kind="hub", hf_repo=repo)
    spec = specs.model_spec_for(alias=alias)
    assert (spec.source, spec.revision) == (repo, sha)
    assert (alias.model.hf_revision, alias.model.hf_sha) == ("", sha)
    with pytest.raises(ValidationError) as info:
        services.alias_register(name="hub2", source_kind="hub", hf_repo="org/none", hf_revision="main")
    assert "no repo org/none" in info.value.message_dict["hf_repo"][0]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        pytest.param(lambda d: _edit_config(d, auto_map={"AutoModel": "x.Y"}), "remote code", id="auto-map"),
        pytest.param(lambda d: _edit_config(d, model_file="modeling.py"), "remote code", id="model-file"),
        pytest.param(
            lambda d: (d / "pytorch_model.bin").write_bytes(b"x"), "non-safetensors", id="pickle-weights"
        ),
        pytest.param(lambda d: (d / "model.safetensors").unlink(), "no model", id="no-weights"),
        pytest.param(lambda d: (d / "config.json").unlink(), "no config.json", id="no-config"),
    ],
)
def test_unsafe_or_incomplete_folders_are_refused(tiny_model_dir, mutate, message):
    bad = tiny_model_dir.parent / "tiny-bad"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(tiny_model_dir, bad)
    try:
        mutate(bad)
        with pytest.raises(ValidationError) as info:
            services.alias_register(name="bad", source_kind="local", local_path="tiny-bad")
        assert message in " ".join(info.value.message_dict["local_path"])
        assert not ModelAlias.objects.filter(name="bad").exists()
    finally:
        shutil.rmtree(bad)


@pytest.mark.parametrize("path", ["/etc", "../outside", "tiny-llama/../../x"])
def test_local_path_must_stay_under_models_root(path, tiny_model_dir):
    with pytest.raises(ValidationError) as info:
        services.alias_register(name="esc", source_kind="local", local_path=path)
    assert "MODELS_ROOT" in " ".join(info.value.message_dict["local_path"])


def test_sampling_merge_prefers_request_then_alias(tiny_alias):
    tiny_alias.temperature, tiny_alias.top_p, tiny_alias.max_tokens = 0.3, 0.9, 40
    params = specs.sampling_params_for(alias=tiny_alias, overrides={"top_p": 0.5, "seed": 7, "stop": ["x"]})
    assert (params.temperature, params.top_p, params.max_tokens, params.seed, params.stop) == (
        0.3,
        0.5,
        40,
        7,
        ("x",),
    )


def test_purge_expired_responses_is_idempotent(user):
    """PER-5 (expired rows): the periodic task deletes expired responses and is idempotent."""
    now = timezone.now()
    common = {
        "owner": user,
        "alias_name": "tiny",
        "instance_id": 1,
        "weights_fingerprint": "f",
        "boot_id": "b",
    }
    StoredResponse.objects.create(public_id="resp_old", expires_at=now - timedelta(seconds=1), **common)
    StoredResponse.objects.create(public_id="resp_new", expires_at=now + timedelta(days=1), **common)
    from models_app.persistence.tasks import responses_purge_expired

    assert responses_purge_expired.delay().get() == 1
    assert responses_purge_expired.delay().get() == 0
    assert list(StoredResponse.objects.values_list("public_id", flat=True)) == ["resp_new"]


def test_bootstrap_command_prints_login_and_key_once(capsys, monkeypatch):
    monkeypatch.delenv("MLXHOST_BOOTSTRAP_API_KEY", raising=False)
    monkeypatch.delenv("DJANGO_SUPERUSER_PASSWORD", raising=False)
    call_command("mlxhost_bootstrap")
    first = capsys.readouterr().out
    raw = next(w for w in first.split() if w.startswith("mlxh_"))
    assert selectors.apikey_authenticate(raw_key=raw) is not None
    call_command("mlxhost_bootstrap")
    second = capsys.readouterr().out
    assert "mlxh_" not in second
    assert ApiKey.objects.count() == 1


@pytest.mark.parametrize(
    ("url", "prefix"),
    [
        (None, ""),
        (
            "postgres://postgres@127.0.0.1:5432/mlxhost_fleet",
            "DATABASE_URL=postgres://postgres@127.0.0.1:5432/mlxhost_fleet ",
        ),
        ("postgres://ops:s3cret@db:5432/mlxhost", 'DATABASE_URL="$DATABASE_URL" '),
    ],
    ids=["sqlite", "fleet-default", "with-password"],
)
def test_bootstrap_hints_name_the_database_they_ran_on(capsys, monkeypatch, url, prefix):
    """Issue 25: the banner's `make api-key` and `changepassword` hints reach the database this
    run used when pasted (the fleet's PostgreSQL, not the default SQLite); a password in the URL
    is referred to, never printed; a port other than 8000 is passed on."""
    monkeypatch.delenv("MLXHOST_BOOTSTRAP_API_KEY", raising=False)
    monkeypatch.delenv("DJANGO_SUPERUSER_PASSWORD", raising=False)
    if url is None:
        monkeypatch.delenv("DATABASE_URL", raising=False)
    else:
        monkeypatch.setenv("DATABASE_URL", url)
    call_command("mlxhost_bootstrap", port="9000")
    capsys.readouterr()
    call_command("mlxhost_bootstrap", port="9000")
    out = capsys.readouterr().out
    assert f"mint another: {prefix}make api-key PORT=9000)" in out
    assert f"reset: {prefix}.venv/bin/python manage.py changepassword admin)" in out
    assert "s3cret" not in out


def test_bootstrap_banner_names_the_chat_page_and_the_anthropic_base_url(capsys, monkeypatch):
    """A new user's walk: the banner gave the OpenAI base URL only, and no way to the chat page."""
    monkeypatch.delenv("MLXHOST_BOOTSTRAP_API_KEY", raising=False)
    call_command("mlxhost_bootstrap", port="9000")
    out = capsys.readouterr().out
    assert "  Chat:      http://127.0.0.1:9000/dashboard/chat/\n" in out
    assert "  Anthropic: base_url=http://127.0.0.1:9000   model=smollm2\n" in out


def test_django_axes_start_banner_is_not_logged_at_info():
    """`make run` printed "AXES: BEGIN version ..." once per manage.py command (four times)."""
    import logging

    assert not logging.getLogger("axes.apps").isEnabledFor(logging.INFO)
    assert logging.getLogger("axes.handlers.database").isEnabledFor(logging.WARNING)


def test_bootstrap_honours_environment(monkeypatch, capsys, django_user_model):
    monkeypatch.setenv("MLXHOST_BOOTSTRAP_API_KEY", "ci-key-0123456789abcdef")
    monkeypatch.setenv("DJANGO_SUPERUSER_USERNAME", "ops")
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "s3cret-pass-word")
    call_command("mlxhost_bootstrap")
    out = capsys.readouterr().out
    assert "ci-key-0123456789abcdef" not in out and "s3cret-pass-word" not in out
    ops = django_user_model.objects.get(username="ops")
    assert ops.is_staff and ops.check_password("s3cret-pass-word")
    assert selectors.apikey_authenticate(raw_key="ci-key-0123456789abcdef").owner == ops


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_the_demo_batches_by_default_and_keeps_a_lane_staff_changed(db):
    """Issue 12, item 5: `make run`'s demo serves up to 8 requests at once, like mlx_lm.server;
    preparing it again (every `make run`) leaves a lane staff have edited alone."""
    from django.core.management import call_command

    from models_app.models import ModelAlias

    call_command("mlxhost_prepare_demo", alias="demo-test", stdout=io.StringIO())
    model = ModelAlias.objects.select_related("model").get(name="demo-test").model
    assert (model.concurrency, model.pinned) == (8, True)
    model.concurrency = 3
    services.model_save(model=model)
    call_command("mlxhost_prepare_demo", alias="demo-test", stdout=io.StringIO())
    model.refresh_from_db()
    assert model.concurrency == 3
