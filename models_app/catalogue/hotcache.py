"""In-process caches of the reads every API request makes (API keys, aliases), kept a few seconds.

Under ASGI every sync ORM call runs on asgiref's one sync thread, so in a burst each request's
key and alias lookups queue behind the others' and a refusal that needs no database waited for
all of them (195-345 ms). With these caches a warm request reaches the lane without touching the
database. Writes made in this process clear the caches at once (on commit); writes made in
another process are seen within the TTL (or at once, for aliases, via `models.changed`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

    from models_app.accounting.identity import KeyIdentity
    from models_app.models import ModelAlias

# A key revoked (or an owner deactivated) in another process is refused within this many seconds;
# in this process, at once. Keep it <= 5 s.
KEY_TTL_S = 2.0
# An alias edited in another process without a channel layer is seen within this many seconds.
ALIAS_TTL_S = 5.0
MAX_ENTRIES = 4096


class _Miss(enum.Enum):
    """The type of `MISS`: a one-member enum, so `is MISS` narrows a lookup's type."""

    MISS = enum.auto()


MISS: Final = _Miss.MISS

V = TypeVar("V")


class TtlCache(Generic[V]):
    """A small thread-safe LRU map whose entries expire `ttl_s` after they were stored.

    `clear()` bumps a generation, and `put()` drops a value read under an older generation, so
    a lookup that raced a write never stores what the write replaced.
    """

    def __init__(
        self, ttl_s: float, max_entries: int = MAX_ENTRIES, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[Any, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()
        self.generation = 0

    def get(self, key: Any) -> V | Literal[_Miss.MISS]:
        """The cached value, or `MISS`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return MISS
            if entry[0] <= self._clock():
                del self._entries[key]
                return MISS
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: Any, value: V, generation: int) -> None:
        with self._lock:
            if generation != self.generation:
                return
            self._entries[key] = (self._clock() + self.ttl_s, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._entries.clear()


api_keys: TtlCache[KeyIdentity | None] = TtlCache(KEY_TTL_S)  # None: no live key has that hash
aliases: TtlCache[ModelAlias | None] = TtlCache(ALIAS_TTL_S)  # None: no enabled alias has that name


def clear_all() -> None:
    """Forget every cached read (tests; a models.changed message clears the aliases only)."""
    api_keys.clear()
    aliases.clear()
