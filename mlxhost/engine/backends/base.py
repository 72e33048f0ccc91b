"""The backend interface: how the engine's worker thread loads and runs a model."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mlxhost.engine.types import Message, ModelSpec, SamplingParams

ProgressCallback = Callable[[int, int], None]  # (done, total) in bytes


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token: its decoded text segment (may be empty) and id."""

    text: str
    token_id: int


@dataclass(frozen=True, slots=True)
class StepEnd:
    """End of a backend generation: trailing text and why it stopped ("stop" or "length")."""

    text: str
    finish_reason: str


class LoadedModel(Protocol):
    """A model resident in memory. Only the instance's worker thread calls `generate`.

    A KV cache (`kv`) is an opaque per-request object holding the tokens fed so far; the
    engine keeps finished ones as warm sessions and feeds only a new prompt's suffix.
    `shared_cache` is true for models whose cache is one shared mutable state (SES-5).
    """

    shared_cache: bool

    def render_chat(self, messages: Sequence[Message]) -> list[int]:
        """Apply the chat template with a generation prompt and return token ids."""
        ...

    def encode(self, text: str) -> list[int]:
        """Tokenize raw text (legacy completions)."""
        ...

    def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, kv: object
    ) -> Iterator[TokenStep | StepEnd]:
        """Feed `prompt_ids` on top of `kv`, then yield one `TokenStep` per token and one `StepEnd`.

        The cache grows in place; `cache_length(kv)` says how many tokens it then holds.
        """
        ...

    def new_cache(self) -> object: ...

    def trim_cache(self, kv: object, n: int) -> None:
        """Drop the last `n` tokens from `kv`."""
        ...

    def cache_length(self, kv: object) -> int: ...

    def cache_nbytes(self, kv: object) -> int: ...

    def dispose_cache(self, kv: object) -> None: ...

    def memory_bytes(self) -> int: ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def load(self, spec: ModelSpec, progress: ProgressCallback) -> LoadedModel: ...
