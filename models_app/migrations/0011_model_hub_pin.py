import re

from django.db import migrations, models

COMMIT = re.compile(r"[0-9a-f]{40}")


def pin_commits(apps, schema_editor):
    """A hub model whose revision is already a commit sha is pinned to it; a branch or a tag is
    resolved the next time the model is saved (no network here)."""
    Model = apps.get_model("models_app", "Model")
    for model in Model.objects.filter(source_kind="hub", hf_sha=""):
        if COMMIT.fullmatch(model.hf_revision):
            Model.objects.filter(pk=model.pk).update(hf_sha=model.hf_revision)


class Migration(migrations.Migration):
    """Hub revisions pinned to a commit (issue 28): `hf_sha` beside the requested revision."""

    dependencies = [
        ("models_app", "0010_model_draft"),
    ]

    operations = [
        migrations.AddField(
            model_name="model",
            name="hf_sha",
            field=models.CharField(
                blank=True,
                editable=False,
                help_text="What loads: the commit the revision named when saved. Check for updates / Update move it.",
                max_length=40,
                verbose_name="pinned commit",
            ),
        ),
        migrations.AlterField(
            model_name="model",
            name="hf_revision",
            field=models.CharField(
                blank=True,
                help_text="A branch, tag or commit (empty: main).",
                max_length=128,
                verbose_name="revision",
            ),
        ),
        migrations.RunPython(pin_commits, migrations.RunPython.noop),
    ]
