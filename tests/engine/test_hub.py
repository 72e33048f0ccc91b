"""Hub revisions and downloads against a local fake hub (issue 28): resolve, download with
per-file progress, resume, the free-space check, 404, 401, gated, offline, and a token that never
reaches a log line or a message."""

from __future__ import annotations

import logging
import os
from collections import namedtuple

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
        p: c for p, c in files.items() if p != "README.md"  # not a file a load needs
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
        MlxBackend().load(ModelSpec(instance_id=1, source=REPO, revision="a" * 40, fingerprint="f"), Progress())
