"""Loading reports progress in bytes as the weights are read (OPS-4)."""

from __future__ import annotations

import shutil

import pytest

from mlxhost.engine.backends.mlx import folders as mlx_folders
from mlxhost.engine.backends.mlx.backend import MlxBackend
from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.types import ModelSpec


def spec_for(folder) -> ModelSpec:
    return ModelSpec(instance_id=1, source=str(folder), fingerprint="f")


def test_a_local_load_reports_every_chunk_up_to_the_folder_size_then_builds(tiny_model_dir, monkeypatch):
    """OPS-4: progress climbs monotonically from 0 to the folder's byte size, chunk by chunk, in
    the "read" phase; then the "build" phase (mlx-lm makes the model) says so, with nothing to
    count, so a page never shows "100 %" for the seconds the build takes."""
    monkeypatch.setattr(mlx_folders, "READ_CHUNK", 4096)
    calls: list[tuple[int, int, str]] = []

    def progress(done: int, total: int, unit: str = "bytes", phase: str = "") -> None:
        calls.append((done, total, phase or {"bytes": "read", "files": "download"}[unit]))

    model = MlxBackend().load(spec_for(tiny_model_dir), progress)
    size = sum(p.stat().st_size for p in tiny_model_dir.iterdir() if p.is_file())
    *reads, build = calls
    assert build == (0, 0, "build")
    assert reads[0] == (0, size, "read")
    assert reads[-1] == (size, size, "read")
    assert {(total, phase) for _, total, phase in reads} == {(size, "read")}
    dones = [done for done, _, _ in reads]
    assert dones == sorted(dones)
    assert len(reads) >= size // 4096  # one report per chunk read
    model.close()


def test_an_unreadable_weight_file_fails_the_load_with_its_name(tiny_model_dir, tmp_path):
    """OPS-4: a failed load carries its reason."""
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="could not load"):
        MlxBackend().load(spec_for(folder), lambda *report: None)
