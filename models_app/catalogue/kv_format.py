"""The KV cache setting a model can take (issue 28): checked when the model is saved."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from django.core.exceptions import ValidationError

from mlxhost.engine import detect_kind

if TYPE_CHECKING:
    from pathlib import Path

    from models_app.models import Model


def kv_format_check(*, model: Model, folder: Path) -> None:
    """A KV setting the local folder's model can take (issue 28): a chat model, and a group size that
    divides its head dimension, read from its config (a hub model is checked when it loads).

    Raises:
        ValidationError: keyed by the KV field at fault.
    """
    if model.kv_bits is None:
        return
    if detect_kind(folder) == "embedding":
        raise ValidationError({"kv_bits": "An embedding model keeps no KV cache; leave this empty."})
    try:
        config = json.loads((folder / "config.json").read_text())
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return  # not a config this check can read: the load says what is wrong
    if head_dim % model.kv_group_size:
        raise ValidationError(
            {
                "kv_group_size": f"This model's head dimension is {head_dim}: choose a group size that "
                f"divides it (32, 64 or 128)."
            }
        )
