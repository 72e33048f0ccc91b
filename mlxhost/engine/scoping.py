"""Cache scoping (SES-3): what a request may reuse from the prefix cache, as fingerprints under a
per-boot secret, so that one tenant's keys and salts never match another's."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SessionQuery:
    """What a request may reuse; every field except the ids is a fingerprint, never a raw value."""

    domain: str  # fingerprint of (tenant, cache salt): the cache domain
    instructions: str  # fingerprint of the instructions / system prompt
    previous_response_id: str | None = None  # tier 1
    cache_key: str | None = None  # tier 2: tenant-scoped fingerprint of prompt_cache_key
    warm_any: bool = False  # tier 3 (Anthropic messages): any warm slot of the instance


class SessionScoper:
    """Fingerprints under a per-boot secret; raw keys and salts never leave this object."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def __repr__(self) -> str:
        return "SessionScoper(<secret>)"

    def query(
        self,
        *,
        tenant: str,
        salt: str | None = None,
        instructions: str = "",
        previous_response_id: str | None = None,
        prompt_cache_key: str | None = None,
        warm_any: bool = False,
        adapter: str = "",
    ) -> SessionQuery:
        """Build a `SessionQuery` bound to `tenant` (SES-3): another tenant gets other fingerprints.
        `adapter` (a LoRA adapter's fingerprint, issue 28) is part of the domain: KV computed under
        one adapter is never reused under another or under the base, in memory or on disk."""
        salt = salt or ""
        key = None if prompt_cache_key is None else self._mac("key", tenant, salt, prompt_cache_key)
        under = ("adapter", adapter) if adapter else ()
        return SessionQuery(
            domain=self._mac("domain", tenant, salt, *under),
            instructions=self._mac("instr", instructions),
            previous_response_id=previous_response_id,
            cache_key=key,
            warm_any=warm_any,
        )

    def _mac(self, *parts: str) -> str:
        message = "\0".join(parts).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()
