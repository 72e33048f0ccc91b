"""Memory the process keeps after its requests: giving it back at idle, and reading it (issue 25);
and a dropped KV cache's arrays, freed through the model resident now (`KvDisposer`).

Two things hold freed memory. MLX keeps freed buffers in its cache for reuse (bounded by its
cache limit, `EngineConfig.mlx_cache_limit_bytes`), and glibc keeps freed heap pages in its
arenas: a huge prompt's tokenizer buffers, its JSON and its strings are freed but stay resident.
`HeapTrimmer` empties both once the engine is idle, through the backend's `release_memory()` and
glibc's `malloc_trim(0)`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import LoadedModel

logger = logging.getLogger(__name__)

# RSS growth since the last trim that makes an idle engine trim again, work or not.
RSS_SLACK_BYTES = 32 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give glibc's free heap pages back to the OS; False where the C library has no malloc_trim."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc does not tell)."""
    try:
        return int(Path("/proc/self/statm").read_bytes().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """Decides when an idle engine gives memory back, and does it (in a thread: it may take ms).

    Due when work ran since the last trim (a request arrived or left: `last_use` moved) or RSS
    grew by more than `RSS_SLACK_BYTES` since then (requests refused before the engine still
    allocate); `trims` counts the trims done.
    """

    def __init__(self, release: Callable[[], None], rss: Callable[[], int] = rss_bytes) -> None:
        self._release = release
        self._rss = rss
        self._use_at_trim: float | None = None
        self._rss_at_trim = 0
        self.trims = 0

    def due(self, last_use: float) -> bool:
        if self._use_at_trim is None or last_use > self._use_at_trim:
            return True
        return self._rss() > self._rss_at_trim + RSS_SLACK_BYTES

    def trim(self, last_use: float) -> None:
        """Empty the backend's buffer cache and glibc's free pages (any thread)."""
        self._use_at_trim = last_use
        try:
            self._release()
        except Exception:  # a backend's bug must not stop glibc's trim or the housekeeping
            logger.exception("the backend could not release its cached memory")
        trim_heap()
        self._rss_at_trim = self._rss()
        self.trims += 1


class HoldsModel(Protocol):
    """What holds an instance's resident model (its worker): None while it is not loaded."""

    @property
    def model(self) -> LoadedModel | None: ...


class KvDisposer:
    """Frees a KV cache the prefix cache dropped, through the model resident now (SES-6); with
    none resident, its arrays went with the model. The session cache's `dispose`."""

    def __init__(self, holder: HoldsModel) -> None:
        self._holder = holder

    def __call__(self, kv: object) -> None:
        model = self._holder.model
        if model is not None:
            model.dispose_cache(kv)
