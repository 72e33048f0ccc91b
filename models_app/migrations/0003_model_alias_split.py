"""Split weights from names: a Model holds the source, lane and memory policy; an alias keeps its
name, sampling and limits and points at one Model (issue 11).

Aliases of the same source become aliases of one Model. Where they disagreed on a lane or memory
setting the Model takes the most generous value, and its description records what each alias had,
so nothing is lost. The reverse copies the Model's settings back onto each alias.
"""

from __future__ import annotations

import django.core.validators
import django.db.models.deletion
from django.db import migrations, models

MODEL_FIELDS = (
    "pinned",
    "keep_alive_s",
    "concurrency",
    "queue_depth",
    "queue_unbounded",
    "queue_timeout_s",
)
SOURCE_FIELDS = ("source_kind", "local_path", "hf_repo", "hf_revision")


def _most_generous(values: list, *, none_wins: bool) -> object:
    if none_wins and any(value is None for value in values):
        return None
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _merge_note(aliases: list) -> str:
    differing = [field for field in MODEL_FIELDS if len({getattr(alias, field) for alias in aliases}) > 1]
    if not differing:
        return ""
    parts = [
        f"{alias.name}: " + ", ".join(f"{field}={getattr(alias, field)}" for field in differing)
        for alias in aliases
    ]
    return "Merged aliases had " + "; ".join(parts)


def split_forward(apps, schema_editor) -> None:
    Alias = apps.get_model("models_app", "ModelAlias")
    Model = apps.get_model("models_app", "Model")
    groups: dict[tuple[str, ...], list] = {}
    for alias in Alias.objects.order_by("pk"):
        groups.setdefault(tuple(getattr(alias, field) for field in SOURCE_FIELDS), []).append(alias)
    taken: set[str] = set()
    for key, aliases in groups.items():
        first = aliases[0]
        name = first.name
        while name in taken:
            name = f"{name}-model"[:64]
        taken.add(name)
        registered = [alias.instance_id for alias in aliases if alias.instance_id is not None]
        note = _merge_note(aliases)
        description = first.description if not note else f"{first.description} {note}".strip()
        model = Model.objects.create(
            name=name,
            description=description[:200],
            **dict(zip(SOURCE_FIELDS, key, strict=True)),
            instance_id=max(registered) if registered else None,
            pinned=any(alias.pinned for alias in aliases),
            keep_alive_s=_most_generous([alias.keep_alive_s for alias in aliases], none_wins=True),
            concurrency=max(alias.concurrency for alias in aliases),
            queue_depth=max(alias.queue_depth for alias in aliases),
            queue_unbounded=any(alias.queue_unbounded for alias in aliases),
            queue_timeout_s=_most_generous([alias.queue_timeout_s for alias in aliases], none_wins=True),
        )
        if len(note) > 200 - len(first.description) - 1:
            # Too long for the description: keep every alias's own values on the alias instead.
            for alias in aliases:
                extra = ", ".join(f"{field}={getattr(alias, field)}" for field in MODEL_FIELDS)
                alias.description = f"{alias.description} (before the split: {extra})".strip()[:200]
        for alias in aliases:
            alias.model_id = model.pk
            alias.save(update_fields=["model", "description"])


def split_backward(apps, schema_editor) -> None:
    Alias = apps.get_model("models_app", "ModelAlias")
    for alias in Alias.objects.select_related("model"):
        for field in (*SOURCE_FIELDS, *MODEL_FIELDS):
            setattr(alias, field, getattr(alias.model, field))
        alias.instance_id = alias.model.instance_id
        alias.save()


class Migration(migrations.Migration):
    dependencies = [
        ("models_app", "0002_instancetombstone"),
    ]

    operations = [
        migrations.CreateModel(
            name="Model",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
                (
                    "name",
                    models.SlugField(
                        help_text="A label for staff; clients use aliases.", max_length=64, unique=True
                    ),
                ),
                ("description", models.CharField(blank=True, max_length=200)),
                (
                    "source_kind",
                    models.CharField(
                        choices=[
                            ("local", "Local folder under MODELS_ROOT"),
                            ("hub", "Hugging Face repo id"),
                        ],
                        default="local",
                        max_length=8,
                    ),
                ),
                (
                    "local_path",
                    models.CharField(
                        blank=True, help_text="A folder relative to MODELS_ROOT.", max_length=512
                    ),
                ),
                (
                    "hf_repo",
                    models.CharField(blank=True, max_length=200, verbose_name="Hugging Face repo id"),
                ),
                (
                    "hf_revision",
                    models.CharField(
                        blank=True,
                        help_text="A commit hash or tag.",
                        max_length=128,
                        verbose_name="pinned revision",
                    ),
                ),
                (
                    "pinned",
                    models.BooleanField(
                        default=False, help_text="Load at start and never unload for idleness."
                    ),
                ),
                (
                    "keep_alive_s",
                    models.PositiveIntegerField(
                        blank=True,
                        default=1800,
                        help_text="Free memory after this many idle seconds (empty: never).",
                        null=True,
                    ),
                ),
                (
                    "concurrency",
                    models.PositiveSmallIntegerField(
                        default=1,
                        help_text="1 = exclusive; N = batched. Every alias of this model shares these slots.",
                        validators=[
                            django.core.validators.MinValueValidator(1),
                            django.core.validators.MaxValueValidator(64),
                        ],
                    ),
                ),
                (
                    "queue_depth",
                    models.PositiveIntegerField(default=16, help_text="Waiters beyond the running requests."),
                ),
                ("queue_unbounded", models.BooleanField(default=False)),
                (
                    "queue_timeout_s",
                    models.FloatField(
                        blank=True, null=True, validators=[django.core.validators.MinValueValidator(0.1)]
                    ),
                ),
                (
                    "instance",
                    models.ForeignKey(
                        blank=True,
                        editable=False,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="models",
                        to="models_app.modelinstance",
                    ),
                ),
            ],
            options={
                "ordering": ["name"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("source_kind", "local_path", "hf_repo", "hf_revision"),
                        name="model_unique_source",
                    )
                ],
            },
        ),
        migrations.AddField(
            model_name="modelalias",
            name="model",
            field=models.ForeignKey(
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="aliases",
                to="models_app.model",
            ),
        ),
        migrations.RunPython(split_forward, split_backward),
        *(
            migrations.RemoveField(model_name="modelalias", name=field)
            for field in (*SOURCE_FIELDS, "instance", *MODEL_FIELDS)
        ),
        migrations.AlterField(
            model_name="modelalias",
            name="model",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="aliases", to="models_app.model"
            ),
        ),
    ]
