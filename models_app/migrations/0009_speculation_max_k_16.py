import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    """`speculation_max_k` defaults to 16: a prediction may fill a 17-token pass (issue 27)."""

    dependencies = [
        ("models_app", "0008_alias_speculation"),
    ]

    operations = [
        migrations.AlterField(
            model_name="modelalias",
            name="speculation_max_k",
            field=models.PositiveSmallIntegerField(
                default=16,
                help_text=(
                    "The cap on tokens drafted for one request in one decode step (1 to 16). Prompt lookup "
                    "drafts at most 8 anyway; a prediction up to 16."
                ),
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(16),
                ],
                verbose_name="most drafted tokens per step",
            ),
        ),
    ]
