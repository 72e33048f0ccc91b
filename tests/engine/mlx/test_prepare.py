"""Tests for preparing MLX model folders: the tiny test model and GGUF conversion."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import pytest

from mlxhost.engine.backends.mlx.gguf import convert_gguf, find_smollm2_gguf
from mlxhost.engine.backends.mlx.tiny import build_tiny_model

if TYPE_CHECKING:
    from pathlib import Path


def _digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def _mtimes(folder: Path) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}


def _chat(folder: Path, question: str, *, max_tokens: int) -> tuple[str, int]:
    # Imported here, not at the top: isort would hoist mlx_lm above the mlxhost
    # imports, and mlx must load after the backend package preloads OpenBLAS.
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(str(folder))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    responses = list(
        mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)
        )
    )
    return "".join(response.text for response in responses), responses[-1].generation_tokens


def test_tiny_build_is_byte_identical_on_rebuild(tmp_path: Path) -> None:
    """Two builds with the same seed produce the same bytes in every file."""
    first = build_tiny_model(tmp_path / "a", seed=0)
    second = build_tiny_model(tmp_path / "b", seed=0)
    assert _digests(first) == _digests(second)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        _digests(first)
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a", "b"]  # no temp siblings left


def test_tiny_build_is_idempotent(tmp_path: Path) -> None:
    """A second build into a complete folder rewrites nothing."""
    folder = build_tiny_model(tmp_path / "tiny", seed=0)
    before = _mtimes(folder)
    assert build_tiny_model(tmp_path / "tiny", seed=0) == folder
    assert _mtimes(folder) == before


def test_tiny_build_with_another_seed_replaces_the_weights(tmp_path: Path) -> None:
    """A different seed rebuilds the folder in place with different weights."""
    folder = build_tiny_model(tmp_path / "tiny", seed=0)
    weights = _digests(folder)["model.safetensors"]
    build_tiny_model(tmp_path / "tiny", seed=1)
    assert _digests(folder)["model.safetensors"] != weights
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny"]


def test_tiny_build_refuses_a_foreign_folder(tmp_path: Path) -> None:
    """A non-empty folder without an mlxhost marker is never replaced."""
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_model(tmp_path, seed=0)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_tiny_model_loads_and_generates(tmp_path: Path) -> None:
    """mlx_lm loads the tiny folder and streams tokens for a chat prompt."""
    _, token_count = _chat(build_tiny_model(tmp_path / "tiny"), "Hello there!", max_tokens=8)
    assert token_count > 0


def test_smollm2_conversion_answers_paris(smollm2_folder: Path) -> None:
    """The converted SmolLM2 answers the capital of France greedily."""
    text, _ = _chat(smollm2_folder, "What is the capital of France?", max_tokens=32)
    assert "Paris" in text


def test_smollm2_conversion_is_idempotent(smollm2_folder: Path) -> None:
    """Converting the same GGUF with the same dtype again rewrites nothing."""
    before = _mtimes(smollm2_folder)
    assert convert_gguf(find_smollm2_gguf(), smollm2_folder) == smollm2_folder
    assert _mtimes(smollm2_folder) == before


def test_convert_refuses_a_non_llama_gguf(tmp_path: Path) -> None:
    """A GGUF of another architecture raises ValueError and leaves no folder."""
    import mlx.core as mx

    gguf = tmp_path / "other.gguf"
    mx.save_gguf(str(gguf), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "qwen2"})
    with pytest.raises(ValueError, match="qwen2"):
        convert_gguf(gguf, tmp_path / "model")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other.gguf"]
