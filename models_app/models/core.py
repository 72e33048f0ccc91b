"""Persistent state: models (weights and their lane), aliases (names and sampling), weights
registrations (instances), API keys and their usage by day, and stored responses. The rows
derived from a Model (quantized copies, LoRA adapters) are in `derived.py`."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import TextChoices

from mlxhost.engine import KVQuantization


class BaseModel(models.Model):
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True


class ModelInstance(models.Model):
    """One registration of specific weights (REG-3).

    The primary key comes from the database sequence (AUTOINCREMENT on SQLite), so instance
    ids are monotonic and never repeat across processes and restarts.
    """

    # TextChoices, not models.TextChoices: django-stubs adds the reverse accessor `models`
    # (Model.instance's related_name) to this class, which shadows the module in its body.
    class SourceKind(TextChoices):
        LOCAL = "local", "Local folder under MODELS_ROOT"
        HUB = "hub", "Hugging Face repo id"

    source_kind = models.CharField(max_length=8, choices=SourceKind.choices)
    source = models.CharField(max_length=512, help_text="Folder relative to MODELS_ROOT, or a repo id.")
    revision = models.CharField(max_length=128, blank=True)
    fingerprint = models.CharField(max_length=64, db_index=True)
    # The KV cache format these weights are served with (`KVQuantization.tag`; "" full precision):
    # part of the instance's identity, so KV of one format is never reused under another.
    kv_format = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    retired_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"#{self.pk} {self.source}{rev} ({self.fingerprint[:12]})"


class Model(BaseModel):
    """Weights the server hosts, and how (REG-3): their source, their kind (a chat, vision or
    embedding model, API-13), the admission lane every alias of them shares (LANE-1/2/8), the
    memory policy (OPS-3) and the admin's load actions (ADM-1).

    Aliases point at a Model; the public names and their sampling live there, never here.
    """

    class Kind(TextChoices):
        CHAT = "chat", "Chat model"
        EMBEDDING = "embedding", "Embedding model"
        # Reads images too (issue 29): served through mlx-vlm, the optional vision extra.
        VISION = "vision", "Vision model (images in)"

    # The kinds every chat surface serves (the engine's `GENERATING_KINDS`).
    GENERATING_KINDS = (Kind.CHAT, Kind.VISION)

    name = models.SlugField(max_length=64, unique=True, help_text="A label for staff; clients use aliases.")
    description = models.CharField(max_length=200, blank=True)
    source_kind = models.CharField(
        max_length=8, choices=ModelInstance.SourceKind.choices, default=ModelInstance.SourceKind.LOCAL
    )
    local_path = models.CharField(max_length=512, blank=True, help_text="A folder relative to MODELS_ROOT.")
    hf_repo = models.CharField(max_length=200, blank=True, verbose_name="Hugging Face repo id")
    hf_revision = models.CharField(
        max_length=128,
        blank=True,
        verbose_name="revision",
        help_text="A branch, tag or commit (empty: main).",
    )
    # The commit the revision named when the model was saved or last updated (issue 28): what
    # loads, and what the fingerprint names, so a branch that moves never changes an instance.
    hf_sha = models.CharField(
        max_length=40,
        blank=True,
        editable=False,
        verbose_name="pinned commit",
        help_text="What loads: the commit the revision named when saved. Check for updates / Update move it.",
    )
    instance = models.ForeignKey(
        ModelInstance, null=True, blank=True, on_delete=models.PROTECT, related_name="models", editable=False
    )
    kind = models.CharField(
        max_length=16,
        choices=Kind.choices,
        default=Kind.CHAT,
        db_index=True,
        help_text=(
            "Detected from a local folder's files when it is saved (sentence-transformers files or a "
            "bare encoder mean an embedding model, a vision tower in config.json a vision model); set it "
            "yourself for a Hugging Face repo."
        ),
    )
    matryoshka = models.BooleanField(
        "Matryoshka embeddings",
        default=False,
        help_text=(
            "For embedding models trained for truncation: clients may ask for fewer `dimensions`, "
            "and get the vector's first ones, renormalised."
        ),
    )
    pinned = models.BooleanField(default=False, help_text="Load at start and never unload for idleness.")
    keep_alive_s = models.PositiveIntegerField(
        null=True,
        blank=True,
        default=1800,
        help_text="Free memory after this many idle seconds (empty: never).",
    )
    concurrency = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text="1 = exclusive; N = batched. Every alias of this model shares these slots.",
    )
    queue_depth = models.PositiveIntegerField(default=16, help_text="Waiters beyond the running requests.")
    queue_unbounded = models.BooleanField(default=False)
    queue_timeout_s = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0.1)])
    # KV cache quantization (issue 28, docs/models.md): the same KV budget holds more tokens.
    # Their help texts are the admin form's (forms.MODEL_HELP).
    kv_bits = models.PositiveSmallIntegerField(
        "KV cache bits",
        null=True,
        blank=True,
        choices=[(8, "8 bits"), (4, "4 bits")],
    )
    kv_group_size = models.PositiveSmallIntegerField(
        "KV group size",
        default=64,
        choices=[(32, "32"), (64, "64"), (128, "128")],
    )
    kv_quantized_start = models.PositiveIntegerField(
        "KV quantized from token",
        default=0,
    )
    # Speculative decoding (docs/speculation.md): a smaller chat model with the same vocabulary
    # drafts tokens that this one verifies. Part of the instance's identity (REG-3): its help
    # text is the admin form's (forms.MODEL_HELP).
    draft_model = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="drafts_for"
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["source_kind", "local_path", "hf_repo", "hf_revision"], name="model_unique_source"
            )
        ]

    # The (repo, revision) that `hf_sha` was resolved for in this process, when it was: the pin
    # then stands for this object's source without asking the database (models_app.catalogue.hub_pins).
    hub_pinned_for: tuple[str, str] | None = None

    def __str__(self) -> str:
        return self.name

    @property
    def kv_format(self) -> str:
        """The KV cache format as the instance records it ("" full precision, embedding models)."""
        if self.kv_bits is None or self.kind == Model.Kind.EMBEDDING:
            return ""
        return KVQuantization(self.kv_bits, self.kv_group_size, self.kv_quantized_start).tag

    @property
    def source_label(self) -> str:
        if self.source_kind == ModelInstance.SourceKind.HUB:
            revision = self.hf_revision or "main"
            pinned = f" ({self.hf_sha[:12]})" if self.hf_sha and self.hf_sha != revision else ""
            return f"{self.hf_repo}@{revision}{pinned}"
        return self.local_path


RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize", "enable_thinking"}
)


def validate_template_kwargs(value: object) -> None:
    """Chat-template options: a JSON object of at most 16 keywords the server does not set itself."""
    if not isinstance(value, dict):
        raise ValidationError('Enter a JSON object, such as {} or {"reasoning_effort": "low"}.')
    if len(value) > 16:
        raise ValidationError("At most 16 options.")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise ValidationError(f"The server sets {', '.join(reserved)} itself (thinking has its own field).")


class ModelAlias(BaseModel):
    """A public name that clients put in `model` (REG-1), with its sampling defaults and limits,
    pointing at the Model whose weights and lane serve it."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="aliases")
    # A LoRA adapter of `model` applied to this alias's requests (issue 28); empty: the base alone.
    adapter = models.ForeignKey(
        "Adapter", null=True, blank=True, on_delete=models.PROTECT, related_name="aliases"
    )
    enabled = models.BooleanField(default=True, db_index=True)

    temperature = models.FloatField(default=0.7, validators=[MinValueValidator(0.0), MaxValueValidator(2.0)])
    top_p = models.FloatField(default=1.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)])
    top_k = models.PositiveIntegerField(default=0, help_text="0 disables top-k.")
    min_p = models.FloatField(default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)])
    repetition_penalty = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0.01)])
    max_tokens = models.PositiveIntegerField(
        default=512,
        validators=[MinValueValidator(1)],
        help_text="Default output length when the request gives none.",
    )
    max_output_tokens = models.PositiveIntegerField(
        default=4096,
        validators=[MinValueValidator(1)],
        help_text="Hard clamp on any request's output length.",
    )
    max_input_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="Refuse prompts longer than this (empty: no limit)."
    )
    # Chat-template switches (API-9): passed to the template as keywords on every request.
    enable_thinking = models.BooleanField(
        "thinking",
        null=True,
        blank=True,
        help_text=(
            "For reasoning models: On lets the model think before it answers (its reasoning is sent "
            "apart from the answer), Off turns thinking off. A request may still choose with Anthropic's "
            "thinking parameter. Models without thinking markers ignore it."
        ),
    )
    # Speculative decoding in the batch (docs/speculation.md): greedy and seeded text is the same
    # either way; it only changes how many tokens one forward pass may produce.
    speculation = models.BooleanField(
        default=True,
        help_text=(
            "Draft tokens from the request's own prompt and output (prompt lookup) or its prediction, "
            "and check them in one pass: the same text, sooner when the answer repeats its input."
        ),
    )
    speculation_max_k = models.PositiveSmallIntegerField(
        "most drafted tokens per step",
        default=16,
        validators=[MinValueValidator(1), MaxValueValidator(16)],
        help_text=(
            "The cap on tokens drafted for one request in one decode step (1 to 16). Prompt lookup "
            "drafts at most 8 anyway; a prediction up to 16."
        ),
    )
    chat_template_kwargs = models.JSONField(
        "chat template options",
        default=dict,
        blank=True,
        validators=[validate_template_kwargs],
        help_text='Other keywords for the chat template, as a JSON object (for example {"reasoning_effort": "low"}).',
    )

    class Meta:
        ordering = ["name"]
        verbose_name = "model alias"
        verbose_name_plural = "model aliases"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(max_tokens__lte=models.F("max_output_tokens")),
                name="alias_default_max_tokens_within_clamp",
            )
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def instance(self) -> ModelInstance | None:
        """The weights registration serving this alias now: its model's."""
        return self.model.instance

    @property
    def instance_id(self) -> int | None:
        return self.model.instance_id

    @property
    def source_label(self) -> str:
        return self.model.source_label


class ApiKey(BaseModel):
    """A hashed API key. The full key is shown once, when created; only the prefix is kept readable."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # Optional limits (KEY-4), checked when a turn arrives on any surface (models_app.accounting.limits).
    requests_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Turns in any 60 seconds, on every surface (empty: no limit).",
    )
    tokens_per_day = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Prompt plus output tokens per UTC day (empty: no limit).",
    )

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class UsageDay(models.Model):
    """What one API key (or one user's browser session, `key` empty) used on one UTC day (KEY-2).

    One row per key per day, incremented with F() expressions by the write-behind flush
    (models_app.accounting.usage), rather than a row per turn rolled up later: the admin's reports read
    keys × days rows however busy the keys are, a flush writes one UPDATE per key whatever the
    number of turns behind it, and the increments from any number of processes add up without
    a lost update or a roll-up job.
    """

    day = models.DateField(db_index=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="usage_days")
    key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="usage_days"
    )
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0, help_text="Prompt tokens served from a cache.")
    output_tokens = models.PositiveBigIntegerField(default=0)
    count_requests = models.PositiveBigIntegerField(
        default=0, help_text="count_tokens calls: they generate nothing and use no tokens."
    )
    # Refused requests (issue 25): over the key's own limits (429 rate_limit_exceeded), and turned
    # away by a busy model (queue full: 429/529; waited past the queue timeout: 503).
    rate_limited = models.PositiveBigIntegerField(default=0, help_text="Refused by the key's limits (429).")
    overloaded = models.PositiveBigIntegerField(
        default=0, help_text="Refused by a busy model: queue full (429/529) or queue timeout (503)."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-day", "owner", "key"]
        verbose_name = "usage by day"
        verbose_name_plural = "usage by day"
        constraints = [
            # Two partial constraints, not one with a nullable column: NULLs never collide in a
            # plain unique constraint, so browser-session rows would duplicate.
            models.UniqueConstraint(
                fields=["day", "key"], condition=models.Q(key__isnull=False), name="usage_day_per_key"
            ),
            models.UniqueConstraint(
                fields=["day", "owner"], condition=models.Q(key__isnull=True), name="usage_day_per_session"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.key or 'browser session'}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class StoredResponse(BaseModel):
    """A generated response kept so a conversation can be continued by id (PER-1)."""

    class Status(models.TextChoices):
        PENDING = "pending"
        IN_PROGRESS = "in_progress"
        COMPLETED = "completed"
        INCOMPLETE = "incomplete"
        FAILED = "failed"
        CANCELLED = "cancelled"

    public_id = models.CharField(max_length=64, unique=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="responses")
    alias = models.ForeignKey(ModelAlias, null=True, blank=True, on_delete=models.SET_NULL)
    alias_name = models.CharField(max_length=64)
    instance_id = models.BigIntegerField()
    weights_fingerprint = models.CharField(max_length=64)
    boot_id = models.CharField(max_length=32)
    previous_response_id = models.CharField(max_length=64, blank=True, db_index=True)
    request = models.JSONField(default=dict)
    output = models.JSONField(default=list)
    output_text = models.TextField(blank=True)
    usage = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING, db_index=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.public_id


class InstanceTombstone(models.Model):
    """An instance id the persist breaker retired while a response's row had not landed (REG-7).

    Kept until that row lands or the tombstone expires; a periodic task deletes it then (PER-5).
    """

    instance_id = models.BigIntegerField()
    source = models.CharField(max_length=512)
    revision = models.CharField(max_length=128, blank=True)
    fingerprint = models.CharField(max_length=64)
    response_public_id = models.CharField(max_length=64, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"#{self.instance_id} for {self.response_public_id}"
