"""What a model costs, as its admin page shows it (issue 28 §5): its weights' bytes, the bytes of
1,000 tokens of KV at its KV setting, how many cached tokens one instance's prefix-cache budget
holds, and the decode speed measured while it serves. Read from the folder's files (config and
safetensors headers), so the admin-only process of a fleet, which loads no model, shows them too."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from mlxhost.engine import KVQuantization, physical_memory_bytes, prefix_cache_bytes, resolve_under
from mlxhost.runtime import runtime_settings
from models_app.models import Model, ModelInstance

# Bytes per number of a safetensors dtype (the activations run in the weights' float dtype).
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True, slots=True)
class ModelCosts:
    weights_bytes: int
    kv_bytes_per_1k: int
    budget_bytes: int
    budget_tokens: int
    kv_format: str  # in words


def model_costs(model: Model) -> ModelCosts | None:
    """The costs of a local chat model's folder; None for a hub model (not on disk here), an
    embedding model (no KV cache) or a folder whose config does not say its shape."""
    if model.source_kind != ModelInstance.SourceKind.LOCAL or model.kind == Model.Kind.EMBEDDING:
        return None
    try:
        folder = resolve_under(Path(settings.MODELS_ROOT), model.local_path)
        config = json.loads((folder / "config.json").read_text())
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        layers = int(config["num_hidden_layers"])
        files = sorted(folder.glob("model*.safetensors"))
        itemsize = _float_itemsize(files[0]) if files else 4
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    q = KVQuantization.from_tag(model.kv_format)
    per_number = q.bytes_per_element(itemsize) if q is not None else itemsize
    per_token = 2 * layers * kv_heads * head_dim * per_number
    budget = prefix_cache_bytes(runtime_settings().engine, physical_memory_bytes())
    words = (
        f"{q.bits}-bit, groups of {q.group_size}"
        if q is not None
        else f"full precision ({itemsize * 8}-bit floats)"
    )
    return ModelCosts(
        weights_bytes=sum(f.stat().st_size for f in files),
        kv_bytes_per_1k=round(per_token * 1000),
        budget_bytes=budget,
        budget_tokens=int(budget // per_token) if per_token else 0,
        kv_format=words,
    )


def _float_itemsize(path: Path) -> int:
    """The size of the first floating tensor's numbers in a safetensors file, from its header."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header: dict[str, Any] = json.loads(handle.read(min(length, 16 << 20)))
    for name, entry in header.items():
        if name != "__metadata__" and entry.get("dtype") in _ITEMSIZE:
            return _ITEMSIZE[entry["dtype"]]
    return 4
