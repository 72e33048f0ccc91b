"""The prefix cache's disk tier: KV caches of stored responses as files, so that continuing a
stored chain after a restart starts from its parent's KV instead of replaying the conversation.

One folder per weights (a digest of the instance's weights key), two files per response:
`<id>.safetensors` (written by the backend: mlx-lm's `save_prompt_cache`) and `<id>.json` (what this tier checks
before anyone loads it: weights, cache domain, instructions, tokens, size and CRC-32 of the kv
file). Both are written to a temporary name and renamed, the kv file first, so a crash leaves at
worst a kv file without its record, which is ignored and deleted. Nothing here touches MLX: the
worker thread saves and loads through the backend (`save_cache`, `load_cache`); probing and
removing run on any thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxhost.engine.sessions import reusable_prefix, tier_figures

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from pathlib import Path

    from mlxhost.engine.sessions import SessionQuery

logger = logging.getLogger(__name__)

KV_SUFFIX = ".safetensors"  # MLX appends it to any name without it
RECORD_SUFFIX = ".json"
TMP_PREFIX = ".tmp-"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_CHUNK = 1 << 20
VERSION = 1


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """A checked kv file: the tokens it holds and how many of them prefix the new prompt."""

    response_id: str
    path: Path
    tokens: tuple[int, ...]
    reuse_tokens: int
    nbytes: int


@dataclass(slots=True)
class DiskStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    partials: int = 0  # never counted here: a saved parent is loaded whole or not at all
    misses: int = 0
    tokens_saved: int = 0
    written: int = 0
    write_failures: int = 0
    discarded: int = 0  # corrupt, partial or foreign files deleted
    evicted: int = 0


def weights_folder(root: Path, weights_key: tuple[str, ...]) -> Path:
    """The folder of one set of weights: a file from other weights is never even looked at."""
    digest = hashlib.sha256("\0".join(weights_key).encode()).hexdigest()[:32]
    return root / digest


def remove_saved(root: Path, response_ids: Iterable[str]) -> int:
    """Delete the saved KV of `response_ids` under every weights folder of `root` (a response was
    deleted, expired or tombstoned); returns how many files went. Any process may call this."""
    removed = 0
    if not root.is_dir():
        return 0
    ids = [r for r in response_ids if _SAFE_ID.match(r)]
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        for response_id in ids:
            for suffix in (RECORD_SUFFIX, KV_SUFFIX):
                try:
                    (folder / f"{response_id}{suffix}").unlink()
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed


class DiskTier:
    """The saved KV caches of one instance's weights, bounded by bytes (oldest use out first).

    Thread-safe: the loop probes (through `asyncio.to_thread`), the worker saves and loads.
    """

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._stats = DiskStats()
        folder.mkdir(parents=True, exist_ok=True)
        self._sweep_partial()
        self._recount()

    @property
    def stats(self) -> DiskStats:
        with self._lock:
            return replace(self._stats)

    def probe(self, response_id: str, query: SessionQuery, prompt_ids: Sequence[int]) -> DiskEntry | None:
        """The saved KV of `response_id` if it may start `prompt_ids` under `query` (same cache
        domain and instructions, SES-3) and its file is whole; a corrupt or partial one is deleted.
        Reads the whole kv file once to check it (the load that follows reads it from the page cache).
        """
        if not _SAFE_ID.match(response_id):
            return None
        record_path = self.folder / f"{response_id}{RECORD_SUFFIX}"
        kv_path = self.folder / f"{response_id}{KV_SUFFIX}"
        if not record_path.exists():
            if kv_path.exists():
                self.discard(response_id, "a kv file without its record")
            return None
        try:
            record = json.loads(record_path.read_text())
            tokens = tuple(int(t) for t in record["tokens"])
            checks = (record["version"], record["size"], record["crc32"])
            if checks != (VERSION, kv_path.stat().st_size, _crc32(kv_path)):
                raise ValueError("its kv file does not match its record")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.discard(response_id, str(exc))
            return None
        if record["domain"] != query.domain or record["instructions"] != query.instructions:
            return None
        reuse = reusable_prefix(tokens, tuple(prompt_ids))
        if reuse == 0:
            return None
        _touch(record_path)
        return DiskEntry(response_id, kv_path, tokens, reuse, int(record["size"]))

    def counted(self, entry: DiskEntry | None) -> None:
        """Count a disk lookup that decided a request's start (a hit when `entry` is not None)."""
        with self._lock:
            if entry is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
                self._stats.tokens_saved += entry.reuse_tokens

    def save(
        self,
        response_id: str,
        query: SessionQuery,
        tokens: Sequence[int],
        write: Callable[[Path], None],
    ) -> bool:
        """Write one response's KV through `write(path)` (the backend's saver, worker thread) with
        its record; then evict the oldest files over the byte bound. False when it failed."""
        if not _SAFE_ID.match(response_id):
            return False
        kv_path = self.folder / f"{response_id}{KV_SUFFIX}"
        tmp_kv = self.folder / f"{TMP_PREFIX}{response_id}{KV_SUFFIX}"
        tmp_record = self.folder / f"{TMP_PREFIX}{response_id}{RECORD_SUFFIX}"
        try:
            write(tmp_kv)
            size = tmp_kv.stat().st_size
            record = {
                "version": VERSION,
                "response_id": response_id,
                "domain": query.domain,
                "instructions": query.instructions,
                "tokens": list(tokens),
                "size": size,
                "crc32": _crc32(tmp_kv),
            }
            tmp_record.write_text(json.dumps(record, separators=(",", ":")))
            tmp_kv.replace(kv_path)
            tmp_record.replace(self.folder / f"{response_id}{RECORD_SUFFIX}")
        except Exception:
            logger.warning("saving the KV cache of %s failed", response_id, exc_info=True)
            for path in (tmp_kv, tmp_record):
                path.unlink(missing_ok=True)
            with self._lock:
                self._stats.write_failures += 1
            return False
        with self._lock:
            self._stats.written += 1
        self._recount()
        self._evict()
        return True

    def discard(self, response_id: str, why: str) -> None:
        """Delete a file that cannot be used (corrupt, partial, unloadable)."""
        logger.warning("ignoring the saved KV cache of %s: %s", response_id, why)
        for suffix in (RECORD_SUFFIX, KV_SUFFIX):
            (self.folder / f"{response_id}{suffix}").unlink(missing_ok=True)
        with self._lock:
            self._stats.discarded += 1
        self._recount()

    def _evict(self) -> None:
        total = self._stats.bytes  # `save` recounted just before
        if total <= self.max_bytes:
            return  # the common case: no listing, no stat of every file
        records = sorted(self.folder.glob(f"*{RECORD_SUFFIX}"), key=_mtime)
        for record in records:
            if total <= self.max_bytes:
                break
            response_id = record.name[: -len(RECORD_SUFFIX)]
            kv = self.folder / f"{response_id}{KV_SUFFIX}"
            total -= _size(kv) + _size(record)
            record.unlink(missing_ok=True)
            kv.unlink(missing_ok=True)
            with self._lock:
                self._stats.evicted += 1
        self._recount()

    def _recount(self) -> None:
        files = [p for p in self.folder.iterdir() if not p.name.startswith(TMP_PREFIX)]
        with self._lock:
            self._stats.entries = sum(1 for p in files if p.name.endswith(RECORD_SUFFIX))
            self._stats.bytes = sum(_size(p) for p in files)

    def _sweep_partial(self) -> None:
        for path in self.folder.glob(f"{TMP_PREFIX}*"):
            path.unlink(missing_ok=True)


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.touch()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def snapshot(stats: DiskStats, max_bytes: int) -> dict[str, Any]:
    return {**tier_figures(stats, max_bytes), "written": stats.written, "discarded": stats.discarded}
