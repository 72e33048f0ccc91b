"""The model folders under MODELS_ROOT that the admin offers for a local model (ADM-1)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from mlxhost.engine import InvalidModelFolderError, resolve_under

MODEL_FOLDER_DEPTH = 2  # MODELS_ROOT/<name> or MODELS_ROOT/<owner>/<name>


def model_folders_available(*, root: Path | None = None) -> list[str]:
    """Folders under MODELS_ROOT that look like mlx-lm models (config.json and *.safetensors),
    relative to it, at most MODEL_FOLDER_DEPTH levels down; what the admin offers for `local_path`.

    Only a shape check: registering one still runs the full validation (remote code, weights).
    """
    root = (root or Path(settings.MODELS_ROOT)).resolve()
    if not root.is_dir():
        return []
    found: list[str] = []
    pending = [(root, 0)]
    while pending:
        folder, depth = pending.pop()
        for child in _subfolders(folder):
            try:
                resolve_under(root, str(child.relative_to(root)))  # a symlink must not leave the root
            except InvalidModelFolderError:
                continue
            if (child / "config.json").is_file() and any(child.glob("*.safetensors")):
                found.append(child.relative_to(root).as_posix())
            elif depth + 1 < MODEL_FOLDER_DEPTH:
                pending.append((child, depth + 1))
    return sorted(found)


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
