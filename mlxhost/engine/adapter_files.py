"""LoRA adapter folders on disk (issue 28): the layout `mlx_lm.lora` writes, read without MLX, checked
against the base model's weights (layer names, shapes, rank), and their fingerprint."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxhost.engine.errors import InvalidAdapterError

if TYPE_CHECKING:
    from pathlib import Path

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
_HEADER_LIMIT = 100 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What an adapter folder holds: its rank and scale, and each adapted layer's (in, out) widths."""

    rank: int
    scale: float
    layers: dict[str, tuple[int, int]]  # module path (model.layers.1.self_attn.q_proj) -> (in, out)

    @property
    def summary(self) -> str:
        return f"rank {self.rank}, scale {self.scale:g}, {len(self.layers)} layers"


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header (the weights are not read)."""
    try:
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > _HEADER_LIMIT:
                raise ValueError("header too large")
            header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise InvalidAdapterError(f"{path.name} is not a readable safetensors file ({exc}).") from exc
    return {
        name: tuple(int(d) for d in meta["shape"]) for name, meta in header.items() if name != "__metadata__"
    }


def read_adapter(folder: Path) -> AdapterInfo:
    """Read an adapter folder in mlx_lm.lora's layout and check it is a plain LoRA adapter.

    Raises:
        InvalidAdapterError: a file is missing or unreadable, it is DoRA or a full fine-tune, or
            its tensors are not pairs of `lora_a` (in, rank) and `lora_b` (rank, out).
    """
    if not folder.is_dir():
        raise InvalidAdapterError(f"{folder.name!r} is not a folder.")
    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise InvalidAdapterError(
            f"{folder.name!r} has no {' or '.join(missing)} (the layout mlx_lm.lora writes)."
        )
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidAdapterError(f"{ADAPTER_CONFIG} is not readable JSON ({exc}).") from exc
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise InvalidAdapterError(
            f"A {kind!r} fine-tune is not a LoRA adapter; only fine_tune_type 'lora' is served."
        )
    params = config.get("lora_parameters") or {}
    try:
        rank, scale = int(params["rank"]), float(params["scale"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidAdapterError(f"{ADAPTER_CONFIG} has no lora_parameters rank and scale.") from exc
    return AdapterInfo(rank, scale, _pairs(safetensors_shapes(folder / ADAPTER_WEIGHTS), rank))


def _pairs(shapes: dict[str, tuple[int, ...]], rank: int) -> dict[str, tuple[int, int]]:
    layers: dict[str, tuple[int, int]] = {}
    errors = []
    for name in sorted(shapes):
        module, _, leaf = name.rpartition(".")
        if leaf == "lora_b":
            continue
        if leaf != "lora_a":
            errors.append(f"{name}: not a LoRA tensor (only lora_a and lora_b are served)")
            continue
        a, b = shapes[name], shapes.get(f"{module}.lora_b")
        if b is None:
            errors.append(f"{module}: lora_a without lora_b")
        elif len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            errors.append(f"{module}: lora_a {a} and lora_b {b} are not (in, rank) and (rank, out)")
        elif a[1] != rank:
            errors.append(f"{module}: rank {a[1]}, but adapter_config.json says rank {rank}")
        else:
            layers[module] = (a[0], b[1])
    errors += [
        f"{n}: lora_b without lora_a"
        for n in shapes
        if n.endswith(".lora_b") and n[:-7] + ".lora_a" not in shapes
    ]
    if errors:
        raise InvalidAdapterError(_listed("The adapter's tensors do not fit together", errors))
    if not layers:
        raise InvalidAdapterError(f"{ADAPTER_WEIGHTS} holds no LoRA layers.")
    return layers


def check_against_base(info: AdapterInfo, base: Path) -> None:
    """Check that every adapted layer is a linear layer of the base model with the same widths.

    Raises:
        InvalidAdapterError: listing each layer the base lacks or whose shape differs.
    """
    try:
        config = json.loads((base / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidAdapterError("The base model's config.json is not readable.") from exc
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(base.glob("model*.safetensors")):
        shapes.update(safetensors_shapes(path))
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    errors = []
    for module, (width_in, width_out) in sorted(info.layers.items()):
        weight = shapes.get(f"{module}.weight")
        if weight is None or len(weight) != 2:
            errors.append(f"{module}: the base model has no such linear layer")
            continue
        out_dims, in_dims = weight
        if f"{module}.scales" in shapes:  # quantized: packed 32-bit words of `bits`-bit weights
            bits = _bits(quantization, module)
            in_dims = in_dims * 32 // bits
        if (in_dims, out_dims) != (width_in, width_out):
            errors.append(
                f"{module}: the adapter maps {width_in} -> {width_out}, the base layer {in_dims} -> {out_dims}"
            )
    if errors:
        raise InvalidAdapterError(_listed("The adapter does not fit the base model", errors))


def _bits(quantization: dict[str, object], module: str) -> int:
    own = quantization.get(module)
    if isinstance(own, dict) and "bits" in own:
        return int(own["bits"])
    bits = quantization.get("bits", 4)
    return int(bits) if isinstance(bits, (int, float, str)) else 4


def _listed(what: str, errors: list[str]) -> str:
    shown = errors[:5] + ([f"and {len(errors) - 5} more"] if len(errors) > 5 else [])
    return f"{what}: " + "; ".join(shown) + "."


def adapter_fingerprint(folder: Path) -> str:
    """SHA-256 over the two adapter files (names and contents); checkpoints beside them are not part of it."""
    digest = hashlib.sha256(b"lora\0")
    for name in ADAPTER_FILES:
        digest.update(name.encode() + b"\0")
        with (folder / name).open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()
