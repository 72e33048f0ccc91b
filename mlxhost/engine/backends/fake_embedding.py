"""The fake backend's embedding model (`FakeBackend.load_embedder`): deterministic vectors."""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mlxhost.engine.backends.fake import FakeBackend
    from mlxhost.engine.types import ModelSpec

# The fake embedder's start and end token ids around a text's characters.
EMBED_START, EMBED_END = 1, 2


class FakeEmbedder:
    """A deterministic embedding model: tokens are the text's characters between a start (1) and
    an end (2) id; a vector depends only on its input's ids, and is unit length."""

    def __init__(self, backend: FakeBackend, spec: ModelSpec) -> None:
        self._backend = backend
        self.spec = spec
        self.closed = False
        self.dimensions = backend.embedding_dimensions
        self.max_tokens = backend.embedding_max_tokens
        self.chars_per_token = 1  # tokens are characters, between a start and an end

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        backend = self._backend
        backend.tokenize_calls += 1
        if backend.before_render is not None:
            backend.before_render(())  # off the loop, like a real tokenizer
        return [[EMBED_START, *(ord(ch) for ch in text), EMBED_END] for text in texts]

    def embed(self, batch: Sequence[Sequence[int]]) -> list[array[float]]:
        backend = self._backend
        backend.wait_for_gate()
        backend.embed_passes.append([list(ids) for ids in batch])
        if backend.embed_failures:
            backend.embed_failures -= 1
            raise RuntimeError("fake embedding failure")
        return [fake_vector(ids, self.dimensions) for ids in batch]

    def memory_bytes(self) -> int:
        return 1024

    def close(self) -> None:
        self.closed = True


def fake_vector(ids: Sequence[int], dimensions: int) -> array[float]:
    """The fake's vector for token ids: unit length, the same ids always give the same vector."""
    raw = [
        math.sin(sum((j + 1) * (i + 1) * t for i, t in enumerate(ids)) % 1000 + j) for j in range(dimensions)
    ]
    norm = math.sqrt(math.fsum(x * x for x in raw)) or 1.0
    return array("f", (x / norm for x in raw))
