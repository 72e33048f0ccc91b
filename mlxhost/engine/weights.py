"""Model folders on disk: safety checks and the weights fingerprint that identifies an instance."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from mlxhost.engine.errors import InvalidModelFolderError

if TYPE_CHECKING:
    from mlxhost.engine.types import ModelKind

# Weight formats that can execute code or that mlx-lm cannot read safely.
UNSAFE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".gguf")
REMOTE_CODE_KEYS = ("auto_map", "model_file")
# The quantized copies mlxhost makes (mlx-lm's affine quantization): bits per weight, group sizes.
QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
_FINGERPRINT_CHUNK = 8 * 1024 * 1024

_memo: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
_memo_lock = threading.Lock()


def validate_model_folder(folder: Path) -> None:
    """Refuse folders mlx-lm should not load: no config, remote code, or non-safetensors weights.

    Raises:
        InvalidModelFolderError: with a message that names the problem.
    """
    if not folder.is_dir():
        raise InvalidModelFolderError(f"{folder.name!r} is not a folder.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InvalidModelFolderError(f"{folder.name!r} has no config.json.")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidModelFolderError(f"{folder.name!r} has an unreadable config.json.") from exc
    _refuse_remote_code(folder, config)
    unsafe = sorted(p.name for p in folder.iterdir() if p.suffix in UNSAFE_WEIGHT_SUFFIXES)
    if unsafe:
        raise InvalidModelFolderError(
            f"{folder.name!r} holds non-safetensors weights ({', '.join(unsafe)}); refused."
        )
    if not any(folder.glob("model*.safetensors")):
        raise InvalidModelFolderError(f"{folder.name!r} has no model*.safetensors weights.")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise InvalidModelFolderError(f"{folder.name!r} has no tokenizer.json.")


def _refuse_remote_code(folder: Path, config: dict[str, object]) -> None:
    # transformers' trust_remote_code imports Python shipped with the weights; mlxhost never runs it.
    wanted = [f"{key} in config.json" for key in REMOTE_CODE_KEYS if key in config]
    if _tokenizer_wants_code(folder):
        wanted.append("auto_map in tokenizer_config.json")
    if wanted:
        raise InvalidModelFolderError(f"{folder.name!r} asks for remote code ({', '.join(wanted)}); refused.")
    scripts = sorted(str(p.relative_to(folder)) for p in _python_files(folder))
    if scripts:
        raise InvalidModelFolderError(
            f"{folder.name!r} ships Python code ({', '.join(scripts[:3])}); "
            "remote code is never run, so the folder is refused."
        )


def _tokenizer_wants_code(folder: Path) -> bool:
    try:
        return "auto_map" in json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False  # missing is fine; a broken one fails at load with mlx-lm's own message


def _python_files(folder: Path) -> list[Path]:
    # Top level and one level down: where hub repos keep modeling_*.py and custom tokenizers.
    return [p for pattern in ("*.py", "*/*.py") for p in folder.glob(pattern) if p.is_file()]


# Files only sentence-transformers folders have: their module list and pooling settings.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "1_Pooling/config.json", "sentence_bert_config.json")
# Architecture name endings of models that generate text; a bare encoder (`BertModel`) embeds.
GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
ENCODER_MODEL_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "nomic_bert", "modernbert"}
)


# Vision-language architectures (issue 29): a config with a `vision_config`, or one of mlx-vlm's
# model types whose config may lack it. Served through the optional vision extra (mlx-vlm).
VISION_MODEL_TYPES = frozenset(
    {
        "llava",
        "llava_next",
        "idefics2",
        "idefics3",
        "smolvlm",
        "qwen2_vl",
        "qwen2_5_vl",
        "paligemma",
        "pixtral",
    }
)
VISION_EXTRA = (
    "Vision models need the optional vision extra (mlx-vlm and Pillow), which is not installed: "
    "run `make install-vision` (or `pip install -r requirements-vision.txt`) and restart the server."
)


def vision_extra_installed() -> bool:
    """Whether mlx-vlm can be imported here (found, not imported: the check is cheap)."""
    return importlib.util.find_spec("mlx_vlm") is not None


def detect_kind(folder: Path) -> ModelKind:
    """Whether a model folder holds a chat, vision or embedding model (API-13), from its files:
    sentence-transformers' files, or a config.json that names a bare encoder, mean embedding; a
    config with a vision tower (`vision_config`, or a vision model type) means vision."""
    if any((folder / name).is_file() for name in SENTENCE_TRANSFORMERS_FILES):
        return "embedding"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "chat"
    if isinstance(config, dict) and (
        isinstance(config.get("vision_config"), dict) or config.get("model_type") in VISION_MODEL_TYPES
    ):
        return "vision"
    architectures = [str(a) for a in config.get("architectures") or []] if isinstance(config, dict) else []
    if any(a.endswith(GENERATIVE_SUFFIXES) for a in architectures):
        return "chat"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type in ENCODER_MODEL_TYPES or any(a.endswith("Model") for a in architectures):
        return "embedding"
    return "chat"


def looks_like_model_folder(folder: Path) -> bool:
    """True when `folder` passes `validate_model_folder` (for listing choices in the admin)."""
    try:
        validate_model_folder(folder)
    except InvalidModelFolderError:
        return False
    return True


def folder_fingerprint(folder: Path) -> str:
    """SHA-256 over every file's relative name and contents; memoised by (name, size, mtime)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    stats = tuple((str(p.relative_to(folder)), (s := p.stat()).st_size, s.st_mtime_ns) for p in files)
    key = (str(folder.resolve()), stats)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(_FINGERPRINT_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    result = digest.hexdigest()
    with _memo_lock:
        _memo[key] = result
    return result


def hub_fingerprint(repo_id: str, revision: str) -> str:
    """A Hugging Face commit is immutable, so repo id + the pinned commit identify the weights."""
    return hashlib.sha256(f"hf\0{repo_id}\0{revision}".encode()).hexdigest()


def with_draft(fingerprint: str, draft_fingerprint: str | None) -> str:
    """The identity of weights served with a draft model (speculative decoding): the target's
    fingerprint joined with its draft's, so another draft is another instance (REG-3).
    Without a draft, the fingerprint itself."""
    if not draft_fingerprint:
        return fingerprint
    return hashlib.sha256(f"draft\0{fingerprint}\0{draft_fingerprint}".encode()).hexdigest()


def resolve_under(root: Path, relative: str) -> Path:
    """Resolve `relative` inside `root`, refusing absolute paths and `..` escapes.

    Raises:
        InvalidModelFolderError: the path leaves `root`.
    """
    if not relative or Path(relative).is_absolute():
        raise InvalidModelFolderError("The folder must be a path relative to MODELS_ROOT.")
    root = root.resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise InvalidModelFolderError("The folder must stay inside MODELS_ROOT.")
    return target
