"""Hub revisions and downloads against a local fake hub (issue 28): resolve, download with
per-file progress, resume, the free-space check, 404, 401, gated, offline, and a token that never
reaches a log line or a message."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections import namedtuple
from fnmatch import fnmatch
from pathlib import Path

import pytest
from huggingface_hub import constants

from mlxhost.engine import hub
from mlxhost.engine.backends.mlx.backend import MlxBackend
from mlxhost.engine.errors import HubError, ModelLoadError
from mlxhost.engine.types import ModelSpec

REPO = "org/tiny"


def weights(n: int = 300_000) -> dict[str, bytes]:
    return {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(n), "README.md": b"hi"}


class Progress:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, str, str, tuple[str, int, int] | None]] = []

    def __call__(self, done, total, unit="bytes", phase="", file=None) -> None:
        self.calls.append((done, total, unit, phase, file))

    def of(self, path: str) -> list[tuple[int, int]]:
        return [(f[1], f[2]) for *_, f in self.calls if f is not None and f[0] == path]


def test_a_branch_a_tag_and_a_sha_resolve_to_the_commit_with_its_files(fake_hub):
    files = weights()
    sha = fake_hub.commit(REPO, files)
    fake_hub.repos[REPO].branches["v1"] = sha
    for revision in ("", "main", "v1", sha):
        commit = hub.hub_resolve(REPO, revision)
        assert commit.sha == sha, revision
    assert {(f.path, f.size) for f in commit.files} == {(p, len(c)) for p, c in files.items()}
    moved = fake_hub.commit(REPO, {**files, "config.json": b"{}"})
    assert hub.hub_resolve(REPO, "main").sha == moved != sha
    assert hub.hub_changes(hub.hub_resolve(REPO, sha), hub.hub_resolve(REPO, "main")) == hub.HubChanges(
        added=(), removed=(), changed=("config.json",)
    )


def test_a_download_reports_bytes_of_the_whole_and_of_each_file(fake_hub):
    files = weights()
    sha = fake_hub.commit(REPO, files)
    progress = Progress()
    folder = hub.hub_download(REPO, sha, progress)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {
        p: c
        for p, c in files.items()
        if p != "README.md"  # not a file a load needs
    }
    wanted = len(files["config.json"]) + len(files["model.safetensors"])
    assert progress.calls[0][:4] == (0, wanted, "bytes", "download")
    assert progress.calls[-1][:2] == (wanted, wanted)
    dones = [c[0] for c in progress.calls]
    assert dones == sorted(dones) and {c[1] for c in progress.calls} == {wanted}
    assert progress.of("model.safetensors")[-1] == (300_000, 300_000)
    assert progress.of("config.json")[-1] == (len(files["config.json"]),) * 2
    assert not [r for r in fake_hub.seen() if r.path.endswith("README.md")]


def test_a_cut_transfer_resumes_from_the_bytes_it_had(fake_hub, monkeypatch):
    """huggingface_hub retries a dropped connection with a Range from the bytes written."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    files = weights()
    sha = fake_hub.commit(REPO, files)
    fake_hub.cut_after["model.safetensors"] = 100_000
    folder = hub.hub_download(REPO, sha, Progress())
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    gets = [r for r in fake_hub.seen() if r.path.endswith("model.safetensors")]
    assert len(gets) == 2 and gets[0].range is None
    assert gets[1].range is not None and 0 < int(gets[1].range.split("=")[1].rstrip("-")) <= 100_000


KILLED_DOWNLOAD = """
import sys
from huggingface_hub import constants
constants.DOWNLOAD_CHUNK_SIZE = 4096
from mlxhost.engine import hub
hub.hub_download(sys.argv[1], sys.argv[2], lambda *a, **k: None)
"""


def test_a_download_killed_mid_file_resumes_from_the_bytes_on_disk(fake_hub, tmp_path):
    """A kill leaves the file's partial blob; the next download asks only for the rest (Range)."""
    files = weights(400_000)
    sha = fake_hub.commit(REPO, files)
    fake_hub.stall_after["model.safetensors"] = 150_000
    env = {
        **os.environ,
        "HF_HUB_CACHE": constants.HF_HUB_CACHE,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    child = subprocess.Popen([sys.executable, "-c", KILLED_DOWNLOAD, REPO, sha], env=env)
    try:
        assert fake_hub.stalled.wait(60), "the child never reached the stalled transfer"
        partials = wait_for(
            lambda: [p for p in Path(constants.HF_HUB_CACHE).rglob("*.mlxhost-partial") if p.stat().st_size]
        )
    finally:
        child.kill()
        child.wait()
    [partial] = partials
    kept = partial.stat().st_size
    assert 0 < kept <= 150_000
    folder = hub.hub_download(REPO, sha, Progress())
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    gets = [r for r in fake_hub.seen() if r.path.endswith("model.safetensors")]
    assert [g.range for g in gets] == [None, f"bytes={kept}-"]
    assert not list(Path(constants.HF_HUB_CACHE).rglob("*.mlxhost-partial"))


def wait_for(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return found


def test_a_download_stopped_part_way_keeps_finished_files_and_serves_nothing(fake_hub):
    """A failed (or killed) download leaves no snapshot to load; the next goes on from the file it lacked."""
    files = {**weights(), "model-00002.safetensors": os.urandom(1000)}
    sha = fake_hub.commit(REPO, files)
    fake_hub.fail_once.add("model.safetensors")
    with pytest.raises(HubError, match="500"):
        hub.hub_download(REPO, sha, Progress())
    folder = hub.hub_download(REPO, sha, Progress())
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    fetched = [r.path.rsplit("/", 1)[1] for r in fake_hub.seen()]
    assert fetched.count("model-00002.safetensors") == 1  # finished before the failure: kept
    assert fetched.count("model.safetensors") == 2


def test_too_little_free_disk_refuses_before_any_byte_is_fetched(fake_hub, monkeypatch):
    sha = fake_hub.commit(REPO, weights())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1_000_000))
    with pytest.raises(HubError, match="Not enough disk space") as raised:
        hub.hub_download(REPO, sha, Progress())
    assert raised.value.reason == "disk"
    assert fake_hub.seen() == []


@pytest.mark.parametrize(
    ("repo", "revision", "reason", "words"),
    [
        ("org/missing", "main", "not_found", "no repo org/missing"),
        (REPO, "no-such-branch", "revision_not_found", "no branch, tag or commit 'no-such-branch'"),
    ],
)
def test_a_missing_repo_or_revision_is_a_404_in_words(fake_hub, repo, revision, reason, words):
    fake_hub.commit(REPO, weights(10))
    with pytest.raises(HubError) as raised:
        hub.hub_resolve(repo, revision)
    assert raised.value.reason == reason
    assert words in str(raised.value)


def test_a_gated_repo_needs_the_token_for_its_files(fake_hub, monkeypatch):
    sha = fake_hub.commit(REPO, weights(1000))
    fake_hub.repos[REPO].gated = True
    monkeypatch.delenv("MLXHOST_HF_TOKEN")
    commit = hub.hub_resolve(REPO, "main")  # a gated repo's metadata is public
    assert commit.gated and commit.sha == sha
    with pytest.raises(HubError, match="is gated") as raised:
        hub.hub_check_access(commit)
    assert raised.value.reason == "gated"
    with pytest.raises(HubError, match="is gated"):
        hub.hub_download(REPO, sha, Progress())
    monkeypatch.setenv("MLXHOST_HF_TOKEN", fake_hub.token)
    hub.hub_check_access(commit)
    assert (hub.hub_download(REPO, sha, Progress()) / "config.json").is_file()


def test_a_private_repo_without_the_token_is_a_401_in_words(fake_hub, monkeypatch):
    fake_hub.commit(REPO, weights(10))
    fake_hub.repos[REPO].private = True
    monkeypatch.setenv("MLXHOST_HF_TOKEN", "hf_wrong_token_value_000000")
    with pytest.raises(HubError, match=r"refused access to org/tiny \(401\)") as raised:
        hub.hub_resolve(REPO, "main")
    assert raised.value.reason == "unauthorized"
    assert "hf_wrong_token_value_000000" not in str(raised.value)


def test_offline_a_complete_cached_commit_loads_and_an_absent_one_says_why(fake_hub, monkeypatch):
    sha = fake_hub.commit(REPO, weights(1000))
    folder = hub.hub_download(REPO, sha, Progress())
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert hub.hub_download(REPO, sha, Progress()) == folder
    with pytest.raises(HubError, match="cannot be reached") as raised:
        hub.hub_download(REPO, "f" * 40, Progress())
    assert raised.value.reason == "offline"


def test_the_token_is_sent_but_never_logged_nor_in_a_message(fake_hub, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    sha = fake_hub.commit(REPO, weights())
    fake_hub.cut_after["model.safetensors"] = 50_000  # a retry logs a warning with the URL
    hub.hub_download(REPO, sha, Progress())
    errors = []
    for repo, revision in (("org/missing", "main"), (REPO, "nope")):
        with pytest.raises(HubError) as raised:
            hub.hub_resolve(repo, revision)
        errors.append(str(raised.value))
    assert all(r.authorization == f"Bearer {fake_hub.token}" for r in fake_hub.requests)
    assert fake_hub.token not in caplog.text
    assert not [e for e in errors if fake_hub.token in e]
    assert hub.scrub(f"x {fake_hub.token} y") == "x [token] y"


def test_the_mlx_backend_loads_the_pinned_commit_from_the_hub(fake_hub, tiny_model_dir):
    """A hub model's spec names the commit; the load downloads it, then reads and builds it."""
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    sha = fake_hub.commit(REPO, files)
    fake_hub.commit(REPO, {**files, "config.json": b"{}"})  # main moved on: the pin is what loads
    progress = Progress()
    model = MlxBackend().load(ModelSpec(instance_id=1, source=REPO, revision=sha, fingerprint="f"), progress)
    try:
        assert model.path.name == sha
        phases = [c[3] or {"bytes": "read"}[c[2]] for c in progress.calls]
        assert phases[0] == "download" and phases[-1] == "build" and "read" in phases
    finally:
        model.close()


def test_an_unreachable_hub_fails_the_load_in_words():
    with pytest.raises(ModelLoadError, match=r"cannot be reached for org/tiny@"):
        MlxBackend().load(
            ModelSpec(instance_id=1, source=REPO, revision="a" * 40, fingerprint="f"), Progress()
        )


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        ("missing", "HubError: The hub has no repo org/tiny"),
        ("gated", "HubError: org/tiny is gated: accept its conditions"),
        ("offline", "HubError: The hub (http://127.0.0.1:9) cannot be reached for org/tiny@"),
    ],
)
async def test_a_hub_refusal_at_load_is_the_instance_error_in_words(fake_hub, monkeypatch, setup, words):
    """Issue 28: what the admin and the Models page show for an instance the hub refused."""
    from mlxhost.engine import Engine, EngineConfig

    sha = "0" * 40 if setup == "missing" else fake_hub.commit(REPO, weights(1000))
    if setup == "gated":
        fake_hub.repos[REPO].gated = True
        monkeypatch.delenv("MLXHOST_HF_TOKEN")
    if setup == "offline":
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    engine = Engine(EngineConfig(), backend=MlxBackend())
    try:
        with pytest.raises(ModelLoadError):
            await engine.load(ModelSpec(instance_id=5, source=REPO, revision=sha, fingerprint="f"))
        [snap] = engine.snapshot()
        assert snap["state"] == "error"
        assert snap["last_error"].startswith(words)
        assert fake_hub.token not in snap["last_error"]
    finally:
        await engine.shutdown()


class RecordingBackend(MlxBackend):
    """The real backend, recording the instance's published progress at each report."""

    def __init__(self, engine_of, seen: list[dict]) -> None:
        self._engine_of, self._seen = engine_of, seen

    def load(self, spec, progress):
        def recording(*args, **kwargs):
            progress(*args, **kwargs)
            self._seen.append(self._engine_of().get(spec.instance_id).snapshot()["load_progress"])

        return super().load(spec, recording)


async def test_the_instance_publishes_the_file_in_flight_while_it_downloads(fake_hub, tiny_model_dir):
    """Issue 28: the Models page's per-file progress comes from the instance's snapshot."""
    from mlxhost.engine import Engine, EngineConfig

    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    sha = fake_hub.commit(REPO, files)
    seen: list[dict] = []
    engine = Engine(EngineConfig(), backend=RecordingBackend(lambda: engine, seen))
    try:
        await engine.load(ModelSpec(instance_id=6, source=REPO, revision=sha, fingerprint="f"))
    finally:
        await engine.shutdown()
    downloads = [p for p in seen if p["phase"] == "download" and p["file"]]
    wanted = sum(len(c) for name, c in files.items() if any(fnmatch(name, pat) for pat in hub.LOAD_PATTERNS))
    assert downloads and {p["total"] for p in downloads} == {wanted}
    last = [p for p in downloads if p["file"] == "model.safetensors"][-1]
    assert last["file_done"] == last["file_total"] == len(files["model.safetensors"])
    assert seen[-1]["phase"] == "build"
