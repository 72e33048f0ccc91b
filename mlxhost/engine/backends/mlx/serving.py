"""The backend the engine runs: mlx-lm's chat and embedding models (`backend.py`), and vision
models through mlx-vlm (`vision.py`), imported only when one loads (the optional vision extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxhost.engine.backends.mlx.backend import MlxBackend, MlxModel
from mlxhost.engine.backends.mlx.folders import model_folder
from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.weights import VISION_EXTRA

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import ProgressCallback
    from mlxhost.engine.types import ModelSpec


class ServingBackend(MlxBackend):
    """`MlxBackend`, and a spec of kind `vision` loaded through mlx-vlm (issue 29)."""

    def load(self, spec: ModelSpec, progress: ProgressCallback) -> MlxModel:
        """As `MlxBackend.load`; a vision model through mlx-vlm.

        Raises:
            ModelLoadError: as `MlxBackend.load`; for a vision model also when the vision extra is
                not installed (the message names `make install-vision`) or mlx-vlm cannot load it.
        """
        if spec.kind != "vision":
            return super().load(spec, progress)
        path = model_folder(spec, progress)
        try:
            from mlxhost.engine.backends.mlx.vision import load_vision
        except ImportError as exc:
            raise ModelLoadError(f"{VISION_EXTRA} ({exc})") from exc
        return load_vision(path)
