"""Loading reports progress in bytes as the weights are read (OPS-4)."""

from __future__ import annotations

import shutil

import pytest

from mlxhost.engine.backends.mlx import backend as mlx_backend
from mlxhost.engine.backends.mlx.backend import MlxBackend
from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.types import ModelSpec


def spec_for(folder) -> ModelSpec:
    return ModelSpec(instance_id=1, source=str(folder), fingerprint="f")


def test_a_local_load_reports_every_chunk_up_to_the_folder_size(tiny_model_dir, monkeypatch):
    """OPS-4: progress climbs monotonically from 0 to the folder's byte size, chunk by chunk."""
    monkeypatch.setattr(mlx_backend, "READ_CHUNK", 4096)
    calls: list[tuple[int, int]] = []
    model = MlxBackend().load(spec_for(tiny_model_dir), lambda done, total: calls.append((done, total)))
    size = sum(p.stat().st_size for p in tiny_model_dir.iterdir() if p.is_file())
    assert calls[0] == (0, size)
    assert calls[-1] == (size, size)
    assert {total for _, total in calls} == {size}
    dones = [done for done, _ in calls]
    assert dones == sorted(dones)
    assert len(calls) >= size // 4096  # one report per chunk read
    model.close()


def test_an_unreadable_weight_file_fails_the_load_with_its_name(tiny_model_dir, tmp_path):
    """OPS-4: a failed load carries its reason."""
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="could not load"):
        MlxBackend().load(spec_for(folder), lambda done, total: None)
