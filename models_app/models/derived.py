"""Catalogue rows derived from a Model (issue 28): its quantized copies, made by a Celery task, and
its LoRA adapters. Django models of the `models_app` app; the rest of the code imports them from
`models_app.models`."""

from __future__ import annotations

from django.db import models
from django.db.models import TextChoices

from mlxhost.engine import QUANT_BITS, QUANT_GROUP_SIZES
from models_app.models.core import BaseModel, Model


class QuantizedCopy(BaseModel):
    """A quantized copy of a local Model's weights, made by the Celery task `model_quantize` (issue 28):
    its settings, its stage while it runs, the Model it registered, and what each side costs (size on
    disk, load time, decode speed of a short greedy run), measured by the task on the same machine."""

    class Status(TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    class Stage(TextChoices):
        LOADING = "loading", "Loading the original"
        QUANTIZING = "quantizing", "Quantizing"
        SAVING = "saving", "Saving the copy"
        MEASURING = "measuring", "Measuring the copy"
        REGISTERING = "registering", "Registering the copy"

    source = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="quantized_copies")
    result = models.OneToOneField(
        Model, null=True, blank=True, on_delete=models.SET_NULL, related_name="quantized_from"
    )
    bits = models.PositiveSmallIntegerField(choices=[(b, f"{b}-bit") for b in QUANT_BITS])
    group_size = models.PositiveSmallIntegerField(choices=[(g, str(g)) for g in QUANT_GROUP_SIZES])
    folder = models.CharField(max_length=512, help_text="The copy's folder, relative to MODELS_ROOT.")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    stage = models.CharField(max_length=16, choices=Stage.choices, blank=True)
    error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    quantized_layers = models.PositiveIntegerField(null=True, blank=True)
    source_bytes = models.BigIntegerField(null=True, blank=True)
    source_load_s = models.FloatField(null=True, blank=True)
    source_tokens_per_s = models.FloatField(null=True, blank=True)
    copy_bytes = models.BigIntegerField(null=True, blank=True)
    copy_load_s = models.FloatField(null=True, blank=True)
    copy_tokens_per_s = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "quantized copies"
        constraints = [
            # One copy of a model per setting at a time: a second click waits for the first.
            models.UniqueConstraint(
                fields=["source", "bits", "group_size"],
                condition=models.Q(status__in=["queued", "running"]),
                name="quantized_copy_one_in_flight",
            )
        ]

    def __str__(self) -> str:
        return f"{self.source.name} at {self.bits} bits, group {self.group_size}"


class Adapter(BaseModel):
    """A LoRA adapter of a base Model (issue 28): a folder under MODELS_ROOT in the layout mlx_lm.lora
    writes, checked against the base when saved, identified by its files' fingerprint. Aliases
    point at one; the engine loads it into the resident base on first use and batches its rows
    with the base's and other adapters' (docs/models.md)."""

    name = models.SlugField(max_length=64, unique=True, help_text="A label for staff, metrics and usage.")
    description = models.CharField(max_length=200, blank=True)
    base = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="adapters")
    local_path = models.CharField(max_length=512, help_text="A folder relative to MODELS_ROOT.")
    # What the check at save found (read only): the files' fingerprint, the rank, scale and layers.
    fingerprint = models.CharField(max_length=64, editable=False, db_index=True)
    rank = models.PositiveSmallIntegerField(null=True, editable=False)
    scale = models.FloatField(null=True, editable=False)
    layers = models.PositiveIntegerField(null=True, editable=False)
    nbytes = models.BigIntegerField(null=True, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
