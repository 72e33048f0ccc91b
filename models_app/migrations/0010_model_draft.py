import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    """A model may name another model as its draft (speculative decoding, issue 27)."""

    dependencies = [
        ("models_app", "0009_speculation_max_k_16"),
    ]

    operations = [
        migrations.AddField(
            model_name="model",
            name="draft_model",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="drafts_for",
                to="models_app.model",
            ),
        ),
    ]
