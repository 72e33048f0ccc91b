"""A local fake of the Hugging Face hub (issue 28): the few routes huggingface_hub 2.x uses to
resolve a revision and download files, served by a threaded `http.server` on 127.0.0.1.

- `GET /api/models/{repo}` and `GET /api/models/{repo}/revision/{rev}` (`?blobs=true`): model
  info, with the commit sha and each file's size and blob id;
- `HEAD` and `GET /{repo}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag` and
  `Content-Length`; a `Range: bytes=N-` asks for the rest from byte N (206).

Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
which huggingface_hub turns into its typed errors. A test moves a branch (`commit`), gates or
privatises a repo, cuts a file's first transfer after some bytes, hangs it (for a kill), or
fails a file once; `requests`
records what came in (method, path, Range, Authorization).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    branches: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> content
    gated: bool = False  # metadata public, files need the token
    private: bool = False  # everything needs the token


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


def blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()  # git's blob id


class FakeHub:
    """The hub's state, and the server that answers for it."""

    def __init__(self, token: str = "hf_fake_secret_token_0123456789") -> None:
        self.token = token
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Seen] = []
        self.cut_after: dict[str, int] = {}  # path -> bytes sent before the first GET is cut
        self.fail_once: set[str] = set()  # paths whose next GET answers 500
        self.stall_after: dict[str, int] = {}  # path -> bytes sent before the first GET hangs
        self.stalled = threading.Event()  # set once a stalled GET has sent its bytes
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def commit(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """A new commit of `files` on `branch` (moving it); returns its sha."""
        repo = self.repos.setdefault(repo_id, FakeRepo())
        listing = json.dumps(sorted((p, blob_id(c)) for p, c in files.items()), separators=(",", ":"))
        sha = hashlib.sha1(f"{repo_id}\0{len(repo.commits)}\0{listing}".encode()).hexdigest()
        repo.commits[sha] = dict(files)
        repo.branches[branch] = sha
        return sha

    def seen(self, method: str = "GET", *, resolve: bool = True) -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if r.method == method and ("/resolve/" in r.path) == resolve]

    # Answers ------------------------------------------------------------------------------------

    def authorized(self, authorization: str | None) -> bool:
        return authorization == f"Bearer {self.token}"

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)

    def take_fault(self, path: str) -> tuple[int | None, bool, int | None]:
        """(bytes to send before cutting the transfer; whether to answer 500; bytes to send before
        hanging), each once."""
        with self._lock:
            cut = self.cut_after.pop(path, None)
            failed = path in self.fail_once
            self.fail_once.discard(path)
            stall = self.stall_after.pop(path, None)
        return cut, failed, stall

    def hang(self) -> None:
        """A stalled transfer: say so, then wait until the hub closes (the client is killed meanwhile)."""
        self.stalled.set()
        self._release.wait()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, *, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            auth = self.headers.get("Authorization")
            hub.record(Seen(self.command, path, self.headers.get("Range"), auth))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._info(f"{parts[2]}/{parts[3]}", parts[5] if len(parts) >= 6 else "main", auth)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), auth, body)
            else:
                self._error(404, "RepoNotFound")

        def _repo(self, repo_id: str, auth: str | None) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound")
            elif repo.private and not hub.authorized(auth):
                self._error(401, "RepoNotFound", "Invalid username or password.")
            else:
                return repo
            return None

        def _sha(self, repo: FakeRepo, revision: str) -> str | None:
            sha = repo.branches.get(revision) or (revision if revision in repo.commits else None)
            if sha is None:
                self._error(404, "RevisionNotFound")
            return sha

        def _info(self, repo_id: str, revision: str, auth: str | None) -> None:
            if (repo := self._repo(repo_id, auth)) is None or (sha := self._sha(repo, revision)) is None:
                return
            siblings = [
                {"rfilename": p, "size": len(c), "blobId": blob_id(c)}
                for p, c in sorted(repo.commits[sha].items())
            ]
            data = {"id": repo_id, "sha": sha, "private": repo.private, "gated": "auto" if repo.gated else False,
                    "siblings": siblings}  # fmt: skip
            self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

        def _file(self, repo_id: str, revision: str, path: str, auth: str | None, body: bool) -> None:
            if (repo := self._repo(repo_id, auth)) is None or (sha := self._sha(repo, revision)) is None:
                return
            if repo.gated and not hub.authorized(auth):
                return self._error(401, "GatedRepo", "Access to this model is restricted.")
            content = repo.commits[sha].get(path)
            if content is None:
                return self._error(404, "EntryNotFound", commit=sha)
            headers = {"X-Repo-Commit": sha, "ETag": f'"{blob_id(content)}"', "Accept-Ranges": "bytes"}
            if not body:
                return self._send(200, b"", {**headers, "Content-Length": str(len(content))}, head=True)
            cut, failed, stall = hub.take_fault(path)
            if failed:
                return self._error(500, "", "Internal Error")
            if stall is not None:
                return self._stall(content, stall, headers)
            start = _range_start(self.headers.get("Range"))
            status = 206 if start else 200
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"
            rest = content[start:]
            headers["Content-Length"] = str(len(rest))
            self._send(status, rest if cut is None else rest[:cut], headers, cut=cut is not None)

        def _stall(self, content: bytes, sent: int, headers: dict[str, str]) -> None:
            self.send_response(200)
            for name, value in {
                **headers,
                "Content-Length": str(len(content)),
                "Connection": "close",
            }.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(content[:sent])
            self.wfile.flush()
            self.close_connection = True
            hub.hang()

        def _error(self, status: int, code: str, message: str = "", commit: str | None = None) -> None:
            headers = {"X-Error-Code": code} if code else {}
            if message:
                headers["X-Error-Message"] = message
            if commit:
                headers["X-Repo-Commit"] = commit
            payload = json.dumps({"error": message or code}).encode()
            self._send(
                status, payload, {**headers, "Content-Type": "application/json"}, head=self.command == "HEAD"
            )

        def _send(self, status: int, payload: bytes, headers: dict[str, str], *, head: bool = False,
                  cut: bool = False) -> None:  # fmt: skip
            self.send_response(status)
            headers.setdefault("Content-Length", str(len(payload)))
            for name, value in headers.items():
                self.send_header(name, value)
            if cut:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if not head:
                self.wfile.write(payload)
                self.wfile.flush()

    return Handler


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    return int(header[len("bytes=") :].split("-", 1)[0] or 0)
