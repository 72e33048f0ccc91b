"""A model's draft model (speculative decoding, docs/speculation.md): what makes a draft valid,
checked before the admin saves it, and the draft's part in the instance's identity."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError

from mlxhost.engine import (
    InvalidModelFolderError,
    detect_kind,
    folder_vocabulary,
    resolve_under,
    vocabulary_mismatch,
)
from models_app.models import Model, ModelInstance

NOT_ITSELF = "A model cannot be its own draft: choose a smaller model with the same tokenizer."
CHAT_ONLY = "Only chat models draft and are drafted for; {name} is an embedding model."
NO_CHAINS = "{name} has a draft model of its own; a draft model cannot have one."
IS_A_DRAFT = "This model is the draft of {names}; a draft model cannot have one itself."
NOT_REGISTERED = "{name} has no registered weights yet; save it first."


def model_draft_check(*, model: Model) -> str | None:
    """Validate `model.draft_model`; return the draft's fingerprint (None without a draft), which
    `weights.with_draft` joins to the model's own: another draft is another instance (REG-3).

    The vocabularies are compared where both tokenizers can be read here (a local folder, or a
    hub revision already in the local Hugging Face cache); otherwise the load compares them.

    Raises:
        ValidationError: keyed "draft_model", in words for the admin form.
    """
    draft = model.draft_model
    if draft is None:
        return None
    if draft.pk is not None and draft.pk == model.pk:
        raise ValidationError({"draft_model": NOT_ITSELF})
    for who in (model, draft):
        if _kind(who) != Model.Kind.CHAT:
            raise ValidationError({"draft_model": CHAT_ONLY.format(name=who.name or "this model")})
    if draft.draft_model_id is not None:
        raise ValidationError({"draft_model": NO_CHAINS.format(name=draft.name)})
    if model.pk is not None:
        targets = sorted(Model.objects.filter(draft_model=model).values_list("name", flat=True))
        if targets:
            raise ValidationError({"draft_model": IS_A_DRAFT.format(names=", ".join(targets))})
    if draft.instance is None:
        raise ValidationError({"draft_model": NOT_REGISTERED.format(name=draft.name)})
    target_folder, draft_folder = tokenizer_folder(model), tokenizer_folder(draft)
    if target_folder is not None and draft_folder is not None:
        target_vocabulary, draft_vocabulary = (
            folder_vocabulary(target_folder),
            folder_vocabulary(draft_folder),
        )
        if target_vocabulary is not None and draft_vocabulary is not None:
            reason = vocabulary_mismatch(target_vocabulary, draft_vocabulary)
            if reason is not None:
                raise ValidationError({"draft_model": reason})
    return draft.instance.fingerprint


def tokenizer_folder(model: Model) -> Path | None:
    """Where the model's tokenizer files are on this machine, if they are (None: not here yet)."""
    if model.source_kind == ModelInstance.SourceKind.LOCAL:
        try:
            return resolve_under(Path(settings.MODELS_ROOT), model.local_path.strip())
        except InvalidModelFolderError:
            return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(
        model.hf_repo.strip(), "tokenizer.json", revision=model.hf_revision.strip()
    )
    return Path(found).parent if isinstance(found, str) else None


def _kind(model: Model) -> str:
    if model.source_kind == ModelInstance.SourceKind.LOCAL:
        folder = tokenizer_folder(model)
        if folder is not None and folder.is_dir():
            return detect_kind(folder)
    return model.kind
