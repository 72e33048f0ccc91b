"""Quantized copies of mlx-lm model folders: mlx-lm's own quantization, stage by stage, published
atomically, with the size, load time and decode speed of the source and of the copy."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load, quantize_model, save

from mlxhost.engine.backends.mlx.tiny import folder_is_built, publish_folder
from mlxhost.engine.errors import InvalidModelFolderError, QuantizationError
from mlxhost.engine.weights import QUANT_BITS, QUANT_GROUP_SIZES, validate_model_folder

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

# What `quantize_folder` reports, in order (the registering stage is the caller's).
STAGES = ("loading", "quantizing", "saving", "measuring")
MEASURE_TOKENS = 32
MEASURE_PROMPT = "Tell me a short story about a river."
QUANTIZED_KEYS = ("quantization", "quantization_config")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One folder's weights on disk, the time mlx-lm took to load them and a short greedy run's speed."""

    weights_bytes: int
    load_s: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class QuantizedCopy:
    """What `quantize_folder` made: the published folder and both sides' measurements."""

    folder: Path
    source: Measurement
    copy: Measurement
    quantized_layers: int


def weights_bytes(folder: Path) -> int:
    """The bytes of the weight files mlx-lm loads from `folder` (`model*.safetensors`)."""
    return sum(p.stat().st_size for p in folder.glob("model*.safetensors"))


def copy_marker(*, source_fingerprint: str, bits: int, group_size: int) -> dict[str, Any]:
    """The build marker of a quantized copy: the same source, bits and group size are the same copy."""
    return {"kind": "quantized", "source": source_fingerprint, "bits": bits, "group_size": group_size}


def quantize_folder(
    source: Path,
    dest: Path,
    *,
    bits: int,
    group_size: int,
    source_fingerprint: str,
    on_stage: Callable[[str], None] = lambda _stage: None,
    measure_tokens: int = MEASURE_TOKENS,
) -> QuantizedCopy:
    """Write an mlx-lm `bits`-bit affine copy of `source` (group size `group_size`) to `dest`.

    The copy is built in a temporary sibling and renamed in (`publish_folder`), so `dest` is
    either absent or complete. A `dest` already built from the same source and settings is reused
    (a redelivered task does not quantize twice). `on_stage` is called with each of `STAGES`.

    Raises:
        QuantizationError: an unsupported or already quantized model, settings mlx cannot use,
            too little free disk space, or a write that failed (the temporary folder is removed).
    """
    if bits not in QUANT_BITS or group_size not in QUANT_GROUP_SIZES:
        raise QuantizationError(
            f"Choose {' or '.join(map(str, QUANT_BITS))} bits and a group size of "
            f"{', '.join(map(str, QUANT_GROUP_SIZES))}."
        )
    _check_source(source)
    marker = copy_marker(source_fingerprint=source_fingerprint, bits=bits, group_size=group_size)
    built = folder_is_built(dest, marker=marker, required=("config.json",))
    if not built:
        _check_free_space(source, dest, bits=bits)  # before the slow part, so a full disk is named at once
    on_stage("loading")
    model, tokenizer, config, source_load_s = _load(source)
    source_speed = _decode_speed(model, tokenizer, measure_tokens)
    source_measured = Measurement(weights_bytes(source), source_load_s, source_speed)
    layers = 0
    if not built:
        on_stage("quantizing")
        model, config, layers = _quantize(model, config, bits=bits, group_size=group_size)
        on_stage("saving")
        _save(source, dest, marker, model, tokenizer, config)
    del model
    mx.clear_cache()
    on_stage("measuring")
    copied, copy_tokenizer, _config, copy_load_s = _load(dest)
    layers = layers or _quantized_layers(copied)
    copy_speed = _decode_speed(copied, copy_tokenizer, measure_tokens)
    copy_measured = Measurement(weights_bytes(dest), copy_load_s, copy_speed)
    del copied
    mx.clear_cache()
    return QuantizedCopy(dest, source_measured, copy_measured, layers)


def _check_source(source: Path) -> None:
    try:
        validate_model_folder(source)
        config = json.loads((source / "config.json").read_text())
    except (InvalidModelFolderError, OSError, ValueError) as exc:
        raise QuantizationError(f"The source folder cannot be quantized: {exc}") from exc
    if any(key in config for key in QUANTIZED_KEYS):
        raise QuantizationError("These weights are quantized already; quantize the full-precision model.")


def _load(folder: Path) -> tuple[Any, Any, dict[str, Any], float]:
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            loaded = cast("tuple[Any, Any, dict[str, Any]]", load(str(folder), return_config=True))
        model, tokenizer, config = loaded
        mx.eval(model.parameters())
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: MLX's own reader
        raise QuantizationError(f"mlx-lm cannot load this model: {exc}") from exc
    return model, tokenizer, config, time.perf_counter() - started


def _quantize(
    model: Any, config: dict[str, Any], *, bits: int, group_size: int
) -> tuple[Any, dict[str, Any], int]:
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints the bits per weight
            model, config = quantize_model(model, config, group_size, bits)
        mx.eval(model.parameters())
    except (ValueError, RuntimeError) as exc:
        raise QuantizationError(f"mlx cannot quantize this model to {bits} bits: {exc}") from exc
    layers = _quantized_layers(model)
    if not layers:
        raise QuantizationError(
            f"No layer of this model has a width that is a multiple of {group_size}; choose a smaller group size."
        )
    return model, config, layers


def _quantized_layers(model: Any) -> int:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)  # type: ignore[attr-defined]  # mlx's stubs lack them
    return sum(1 for _, module in model.named_modules() if isinstance(module, kinds))


def _space_needed(source: Path, bits: int) -> int:
    # `bits`/8 of the source's weight bytes is more than a copy of 16- or 32-bit weights takes
    # (its scales and biases included); the other files are about the same size in the copy.
    others = sum(p.stat().st_size for p in source.iterdir() if p.is_file() and not p.name.startswith("model"))
    return weights_bytes(source) * bits // 8 + others


def _check_free_space(source: Path, dest: Path, *, bits: int) -> None:
    need = _space_needed(source, bits)
    dest.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest.parent).free
    if free < need:
        raise QuantizationError(_disk_full(dest.parent, need, free))


def _disk_full(where: Path, need: int, free: int) -> str:
    return (
        f"Not enough free disk space in {where}: the copy needs about {need / 1e6:.1f} MB, "
        f"{free / 1e6:.1f} MB are free."
    )


def _save(
    source: Path, dest: Path, marker: dict[str, Any], model: Any, tokenizer: Any, config: dict[str, Any]
) -> None:
    bits = int(marker["bits"])

    def write(folder: Path) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            save(folder, source, model, tokenizer, config)

    try:
        publish_folder(dest, marker=marker, required=("config.json",), write=write)
    except FileExistsError as exc:
        raise QuantizationError(f"{dest.name} is in the way: {exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            free = shutil.disk_usage(dest.parent).free
            raise QuantizationError(_disk_full(dest.parent, _space_needed(source, bits), free)) from exc
        raise QuantizationError(f"The copy could not be written: {exc}") from exc


def _decode_speed(model: Any, tokenizer: Any, tokens: int) -> float:
    """Greedy decode tokens per second over `tokens` tokens (EOS suppressed), as mlx-lm counts them."""
    if tokens <= 0:
        return 0.0
    no_eos = make_logits_processors(logit_bias=dict.fromkeys(tokenizer.eos_token_ids, -1e9))
    responses = stream_generate(
        model,
        tokenizer,
        MEASURE_PROMPT,
        max_tokens=tokens,
        sampler=make_sampler(0.0),
        logits_processors=no_eos,
    )
    last = None
    for response in responses:
        last = response
    return float(last.generation_tps) if last is not None else 0.0


def release_thread() -> None:
    """Destroy the streams MLX made for the calling thread, as a thread that quantized ends (see
    `MlxBackend.thread_exit`: a thread that skipped it can abort the process at exit)."""
    mx.clear_streams()
