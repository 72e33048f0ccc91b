"""Who an authenticated API key belongs to: below the catalogue's control, hot caches and reads,
which all carry it, so none of them imports another for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from models_app.accounting.limits import KeyLimits

if TYPE_CHECKING:
    from models_app.models import ApiKey


@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """Who an authenticated API key belongs to: what a request needs, cacheable for seconds."""

    key_id: int
    owner_id: int
    # KEY-4: cached with the key, so a limit edited in another process applies within the TTL.
    limits: KeyLimits = field(default_factory=KeyLimits)

    @classmethod
    def of(cls, key: ApiKey) -> KeyIdentity:
        limits = KeyLimits(requests_per_minute=key.requests_per_minute, tokens_per_day=key.tokens_per_day)
        return cls(key_id=key.pk, owner_id=key.owner_id, limits=limits)
