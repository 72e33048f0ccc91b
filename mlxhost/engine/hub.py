"""The Hugging Face hub as mlxhost uses it (issue 28): a revision resolved to its commit, the
commit's files, and a download of them into huggingface_hub's cache, file by file with progress,
after a free-space check, with a token that never reaches a log line or a message."""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxhost.engine.errors import HubError

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import ProgressCallback

logger = logging.getLogger(__name__)

TOKEN_ENV = "MLXHOST_HF_TOKEN"
DEFAULT_REVISION = "main"
# What a load needs of a repo. "*/config.json": an embedding model's pooling settings.
LOAD_PATTERNS = ("*.json", "*/config.json", "model*.safetensors", "tokenizer.model", "*.jinja", "*.txt")
# Kept free beside the download, so that a full disk never leaves the cache half-written.
DISK_MARGIN_BYTES = 64 * 1024 * 1024
SECRET_SHOWN = "[token]"


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a commit: its path in the repo, its size and its git blob id."""

    path: str
    size: int
    blob_id: str


@dataclass(frozen=True, slots=True)
class HubCommit:
    """A revision of a repo resolved to its commit: the sha and the files it holds."""

    repo_id: str
    revision: str  # as asked ("" asks the default branch)
    sha: str
    files: tuple[HubFile, ...]
    gated: bool = False


@dataclass(frozen=True, slots=True)
class HubChanges:
    """What differs between two commits of a repo, by path (a changed blob id is a changed file)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def hub_token() -> str | None:
    """The server's hub token (`MLXHOST_HF_TOKEN`); None lets huggingface_hub use its own
    (`HF_TOKEN`, or a stored `hf auth login`)."""
    return os.environ.get("MLXHOST_HF_TOKEN", "").strip() or None


def hub_resolve(repo_id: str, revision: str = "") -> HubCommit:
    """The commit `revision` (a branch, a tag or a sha; "" is the default branch) names now.

    Raises:
        HubError: the hub is unreachable, refuses the credentials, or has no such repo or revision.
    """
    from huggingface_hub import HfApi

    asked = revision.strip()
    try:
        info = HfApi(endpoint=_endpoint(), token=hub_token()).model_info(
            repo_id, revision=asked or DEFAULT_REVISION, files_metadata=True
        )
    except Exception as exc:
        raise hub_error(exc, repo_id, asked or DEFAULT_REVISION) from None
    if not info.sha:
        raise HubError(f"The hub named no commit for {repo_id}@{asked or DEFAULT_REVISION}.", "protocol")
    files = tuple(
        HubFile(sibling.rfilename, int(sibling.size or 0), sibling.blob_id or "")
        for sibling in info.siblings or ()
    )
    return HubCommit(repo_id, asked, info.sha, files, gated=bool(info.gated))


def hub_check_access(commit: HubCommit) -> None:
    """Whether the server may download the commit's files: a gated repo's metadata is public, its
    files are not, so ask for one file's headers.

    Raises:
        HubError: the files are refused (gated, or a private repo the token cannot read).
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    probe = next((f.path for f in commit.files if f.path == "config.json"), None)
    if probe is None:
        return
    url = hf_hub_url(commit.repo_id, probe, revision=commit.sha, endpoint=_endpoint())
    try:
        get_hf_file_metadata(url, token=hub_token(), endpoint=_endpoint())
    except Exception as exc:
        raise hub_error(exc, commit.repo_id, commit.sha) from None


def hub_changes(old: HubCommit, new: HubCommit) -> HubChanges:
    """Files added, removed and changed (a new blob id) from `old` to `new`."""
    before = {f.path: f.blob_id for f in old.files}
    after = {f.path: f.blob_id for f in new.files}
    return HubChanges(
        added=tuple(sorted(set(after) - set(before))),
        removed=tuple(sorted(set(before) - set(after))),
        changed=tuple(sorted(p for p in set(before) & set(after) if before[p] != after[p])),
    )


def hub_download(
    repo_id: str, sha: str, progress: ProgressCallback, *, patterns: tuple[str, ...] = LOAD_PATTERNS
) -> Path:
    """The snapshot folder of commit `sha` with every file a load needs, downloaded first where
    the cache lacks them: one file at a time, reporting bytes of the whole and of the file.

    A file is fetched to a partial file that the next attempt resumes from its last byte with an
    HTTP Range request, whether the last one was cut by a dropped connection or by a kill; it
    appears in the snapshot only once complete, and the folder is returned only when every file
    of the commit is in it.

    Raises:
        HubError: the hub is unreachable (and the cache lacks the commit), refuses the download,
            or the disk has too little room for it.
    """
    try:
        commit = hub_resolve(repo_id, sha)
    except HubError as exc:
        if exc.reason != "offline":
            raise
        return _cached_snapshot(repo_id, sha, exc)
    wanted = [f for f in commit.files if _wanted(f.path, patterns)]
    cache = _cache_dir()
    sha = commit.sha  # the same, unless an instance registered before pins names a tag
    missing = [f for f in wanted if _cached_path(repo_id, f.path, sha) is None]
    _check_room(cache, sum(f.size for f in missing))
    total = sum(f.size for f in wanted)
    done = total - sum(f.size for f in missing)
    progress(done, total, "bytes", "download")
    for file in missing:
        _fetch(commit, file, cache, _FileBar.reporting(progress, done, total, file))
        done += file.size
        progress(done, total, "bytes", "download", file=(file.path, file.size, file.size))
    folder = _snapshot_folder(repo_id, sha)
    absent = [f.path for f in wanted if not (folder / f.path).is_file()]
    if absent:
        raise HubError(
            f"The download of {repo_id}@{sha[:12]} is incomplete: {', '.join(absent)}.", "incomplete"
        )
    return folder


def hub_error(exc: BaseException, repo_id: str, revision: str) -> HubError:
    """`exc`, raised by huggingface_hub or its HTTP client, as a message for staff, with any token
    taken out."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = getattr(getattr(exc, "response", None), "status_code", None)
    where = f"{repo_id}@{revision[:12]}" if len(revision) == 40 else f"{repo_id}@{revision}"
    if isinstance(exc, GatedRepoError):
        text, reason = (
            f"{repo_id} is gated: accept its conditions on the hub with the account whose token the "
            f"server uses ({TOKEN_ENV}).",
            "gated",
        )
    elif isinstance(exc, RepositoryNotFoundError) and status == 401:
        text, reason = (
            f"The hub refused access to {repo_id} (401): it is private or gated, or {TOKEN_ENV} is "
            "missing, wrong or expired.",
            "unauthorized",
        )
    elif isinstance(exc, RepositoryNotFoundError):
        text, reason = f"The hub has no repo {repo_id} (or the server's token cannot see it).", "not_found"
    elif isinstance(exc, RevisionNotFoundError):
        text, reason = f"{repo_id} has no branch, tag or commit {revision!r}.", "revision_not_found"
    elif isinstance(exc, RemoteEntryNotFoundError):
        text, reason = f"A file of {where} is missing on the hub.", "not_found"
    elif isinstance(exc, HfHubHTTPError):
        text, reason = f"The hub answered {status} for {where}.", "http"
    elif isinstance(exc, (OfflineModeIsEnabled, ConnectionError, TimeoutError)) or _is_network(exc):
        text, reason = (
            f"The hub ({_endpoint()}) cannot be reached for {where}: {type(exc).__name__}.",
            "offline",
        )
    elif isinstance(exc, OSError):
        text, reason = f"Could not write {where} to the cache: {exc}", "disk"
    else:
        text, reason = f"Could not fetch {where} from the hub: {exc}", "unknown"
    return HubError(scrub(text), reason)


def scrub(text: str) -> str:
    """`text` without any hub token the server could send (ours, or huggingface_hub's own)."""
    from huggingface_hub import get_token

    for secret in {hub_token(), get_token()}:
        if secret:
            text = text.replace(secret, SECRET_SHOWN)
    return text


# Downloading ------------------------------------------------------------------------------------


class _FileBar:
    """What huggingface_hub's `http_get` takes as its progress bar (any class: it calls
    `update(n)`), turned into the engine's progress: the whole download's bytes, and the file's."""

    def __init__(self, report: tuple[ProgressCallback, int, int, HubFile], initial: int = 0) -> None:
        self._progress, self._before, self._total, self._file = report
        self.n = int(initial or 0)  # bytes a resumed attempt already holds

    @classmethod
    def reporting(cls, progress: ProgressCallback, before: int, total: int, file: HubFile) -> type:
        def make(**kwargs: Any) -> _FileBar:  # total, initial, desc, unit: as for a tqdm
            return cls((progress, before, total, file), int(kwargs.get("initial") or 0))

        return make  # type: ignore[return-value]  # a factory in the place of a tqdm class

    def update(self, n: float | None = 1) -> None:
        self.n = max(0, self.n + int(n or 0))
        done = min(self.n, self._file.size)
        self._progress(
            self._before + done,
            self._total,
            "bytes",
            "download",
            file=(self._file.path, done, self._file.size),
        )

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to show: the engine's progress is the record."""

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> _FileBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fetch(commit: HubCommit, file: HubFile, cache: Path, bar: type) -> None:
    """One file into the cache: its blob fetched to a partial file that a later attempt (after a
    kill too) resumes with a Range, renamed into place when complete; then huggingface_hub finds
    the blob and links it into the commit's snapshot, as for any file it downloaded itself."""
    from huggingface_hub import hf_hub_download

    try:
        _fetch_blob(commit, file, cache, bar)
        hf_hub_download(
            commit.repo_id,
            file.path,
            revision=commit.sha,
            cache_dir=cache,
            token=hub_token(),
            endpoint=_endpoint(),
        )
    except HubError:
        raise
    except Exception as exc:
        raise hub_error(exc, commit.repo_id, commit.sha) from None


def _fetch_blob(commit: HubCommit, file: HubFile, cache: Path, bar: type) -> None:
    from urllib.parse import urlsplit

    from filelock import FileLock
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # public, lazily exported

    url = hf_hub_url(commit.repo_id, file.path, revision=commit.sha, endpoint=_endpoint())
    meta = get_hf_file_metadata(url, token=hub_token(), endpoint=_endpoint())
    if meta.etag is None:
        raise HubError(f"The hub gave no ETag for {file.path} of {commit.repo_id}.", "protocol")
    storage = cache / repo_folder_name(repo_id=commit.repo_id, repo_type="model")
    blob = storage / "blobs" / meta.etag
    partial = blob.with_name(f"{meta.etag}.mlxhost-partial")  # one name, so a later attempt finds it
    blob.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(partial) + ".lock"):  # another process fetching the same blob waits for it
        if blob.exists():
            return
        # The token goes to the hub only, never to the CDN a large file is redirected to.
        same_host = urlsplit(meta.location).netloc == urlsplit(url).netloc
        headers = build_hf_headers(token=hub_token() if same_host else False)
        with partial.open("ab") as handle:
            http_get(
                meta.location,
                handle,
                resume_size=handle.tell(),
                headers=headers,
                expected_size=meta.size,
                tqdm_class=bar,
            )
        partial.replace(blob)


def _cached_snapshot(repo_id: str, sha: str, offline: HubError) -> Path:
    """Offline: the commit's snapshot if an earlier download finished it (its index's shards all
    there); otherwise the offline error."""
    folder = _snapshot_folder(repo_id, sha)
    if not (folder / "config.json").is_file() or not _shards_present(folder):
        raise offline
    logger.info("hub unreachable: loading %s@%s from the cache", repo_id, sha[:12])
    return folder


def _shards_present(folder: Path) -> bool:
    import json

    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return (folder / "model.safetensors").is_file()
    shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    return all((folder / shard).is_file() for shard in shards)


def _check_room(cache: Path, needed: int) -> None:
    if not needed:
        return
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed + DISK_MARGIN_BYTES:
        raise HubError(
            f"Not enough disk space for the download: it needs {_mb(needed)} (and {_mb(DISK_MARGIN_BYTES)} "
            f"spare), {cache} has {_mb(free)} free.",
            "disk",
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _wanted(path: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in patterns)


def _cached_path(repo_id: str, path: str, sha: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, path, cache_dir=_cache_dir(), revision=sha)
    return found if isinstance(found, str) else None


def _snapshot_folder(repo_id: str, sha: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return _cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / sha


def _cache_dir() -> Path:
    # huggingface_hub reads HF_HUB_CACHE (or HF_HOME) into its constants at import: read here at
    # each call, so a test may point it elsewhere.
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _endpoint() -> str:
    """The hub's address: `HF_ENDPOINT` as it is now (huggingface_hub read it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or constants.ENDPOINT


def _is_network(exc: BaseException) -> bool:
    import httpx2

    return isinstance(exc, (httpx2.TransportError, httpx2.TimeoutException))
