"""API key format: generation, the lookup prefix and the stored hash (never the secret)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string

KEY_MARK = "mlxh_"
_ALPHABET = string.ascii_letters + string.digits
_PREFIX_BODY = 8


def key_generate() -> str:
    """A new key: `mlxh_<8-char prefix>_<43-char secret>`."""
    body = "".join(secrets.choice(_ALPHABET) for _ in range(_PREFIX_BODY))
    return f"{KEY_MARK}{body}_{secrets.token_urlsafe(32)}"


def key_prefix(raw_key: str) -> str:
    """The indexed lookup part. Keys in our format expose their prefix; others get a hashed one."""
    head = raw_key[: len(KEY_MARK) + _PREFIX_BODY]
    if raw_key.startswith(KEY_MARK) and raw_key[len(head) : len(head) + 1] == "_":
        return head
    return "ext_" + hashlib.sha256(raw_key.encode()).hexdigest()[:12]


def key_hash(raw_key: str) -> str:
    # Keys carry 256 bits of entropy, so a fast hash is enough (no dictionary to attack).
    return hashlib.sha256(raw_key.encode()).hexdigest()


def key_matches(raw_key: str, stored_hash: str) -> bool:
    return hmac.compare_digest(key_hash(raw_key), stored_hash)
