"""A model's folder before its library builds it: validated, a hub revision downloaded first, and
read once with progress (OPS-4); then mlx-lm's load of it. Shared by the chat, draft and vision
loads (backend.py, serving.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_lm import load as mlx_load

from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.hub import hub_download
from mlxhost.engine.weights import validate_model_folder

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import ProgressCallback
    from mlxhost.engine.types import ModelSpec

READ_CHUNK = 16 * 1024 * 1024


def model_folder(spec: ModelSpec, progress: ProgressCallback) -> Path:
    """A chat or vision model's folder, validated and read once (a hub revision downloaded first),
    then the "build" phase announced: what every load does before its library builds the model.

    Raises:
        ModelLoadError: the folder is unsafe or incomplete, or the hub cannot be reached.
    """
    path = Path(spec.source)
    if path.is_absolute():
        validate_model_folder(path)
    else:
        path = download(spec.source, spec.revision, progress)
        validate_model_folder(path)
    read_with_progress(path, progress)
    progress(0, 0, "", "build")  # the library says nothing while it builds: a phase with no count
    return path


def load_folder(spec: ModelSpec, progress: ProgressCallback, what: str = "model") -> tuple[Path, Any, Any]:
    """`model_folder`, then mlx-lm's load of it: (folder, model, tokenizer)."""
    path = model_folder(spec, progress)
    try:
        model, tokenizer = mlx_load(str(path))[:2]
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: MLX's own reader
        raise ModelLoadError(f"mlx-lm could not load the {what}: {exc}") from exc
    return path, model, tokenizer


def read_with_progress(folder: Path, progress: ProgressCallback) -> None:
    """Read the folder's files once, reporting bytes as they come in (OPS-4).

    mlx-lm loads all weights in one call that says nothing while it runs; reading the files
    first moves the slow part (the disk) here, where it can be shown, and leaves mlx-lm to
    read them back from the page cache.
    """
    files = sorted(p for p in folder.glob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    done = 0
    progress(0, total)
    buffer = bytearray(READ_CHUNK)
    for file in files:
        try:
            with file.open("rb", buffering=0) as handle:
                while count := handle.readinto(buffer):
                    done += count
                    progress(min(done, total), total)
        except OSError as exc:
            raise ModelLoadError(f"Could not read {file.name}: {exc}") from exc
    progress(total, total)


def download(repo_id: str, revision: str | None, progress: ProgressCallback) -> Path:
    """The snapshot of the pinned commit (issue 28): a hub model's spec names a sha, resolved when
    the model was saved, so a moved branch never changes what an instance loads."""
    if not revision:
        raise ModelLoadError(f"{repo_id} has no pinned commit: save the model again to pin one.")
    return hub_download(repo_id, revision, progress)
