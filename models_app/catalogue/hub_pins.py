"""Hub models pinned to a commit (issue 28): the sha a revision names when the model is saved,
and whether the revision has moved since (what Check for updates shows and Update takes)."""

from __future__ import annotations

from dataclasses import dataclass

from django.core.exceptions import ValidationError

from mlxhost.engine import HubChanges, HubCommit, HubError, hub_changes, hub_check_access, hub_resolve
from models_app.models import Model, ModelInstance

# Which form field a hub refusal belongs to: a revision the repo lacks is the revision's fault,
# everything else (no such repo, gated, 401, offline) the repo's.
REVISION_REASONS = frozenset({"revision_not_found"})


def hub_pin(*, model: Model, resolve: bool = True) -> str:
    """The commit `model` serves: its pin while it still stands for the model's repo and revision,
    else the commit the revision names now, with access to its files checked, set on `model`
    (the caller saves it). With `resolve` False (a reload), never asks the hub: a model saved
    before pins existed serves its revision as it was.

    Raises:
        ValidationError: keyed by hf_repo or hf_revision, with the hub's refusal in words.
    """
    repo, revision = model.hf_repo.strip(), model.hf_revision.strip()
    if model.hf_sha and _pinned_for(model) == (repo, revision):
        return model.hf_sha
    if not resolve:
        return model.hf_sha or revision
    commit = hub_commit(repo=repo, revision=revision)
    model.hf_sha, model.hub_pinned_for = commit.sha, (repo, revision)
    return commit.sha


def hub_commit(*, repo: str, revision: str) -> HubCommit:
    """`revision` of `repo` resolved, its files readable by the server.

    Raises:
        ValidationError: as for `hub_pin`.
    """
    try:
        commit = hub_resolve(repo, revision)
        if commit.gated:
            hub_check_access(commit)
    except HubError as exc:
        field = "hf_revision" if exc.reason in REVISION_REASONS else "hf_repo"
        raise ValidationError({field: str(exc)}) from None
    return commit


@dataclass(frozen=True, slots=True)
class HubUpdate:
    """What Check for updates found for one model: the pinned commit and the one its revision
    names now, and the files that differ."""

    model: Model
    revision: str
    old_sha: str
    new_sha: str
    changes: HubChanges

    @property
    def moved(self) -> bool:
        return self.old_sha != self.new_sha

    def describe(self) -> str:
        """In words, for the admin's message."""
        name, where = self.model.name, f"{self.model.hf_repo}@{self.revision or 'main'}"
        if not self.moved:
            return f"{name}: {where} is still at {self.old_sha[:12]}; nothing to update."
        parts = [
            f"{label} {', '.join(paths)}"
            for label, paths in (
                ("changed", self.changes.changed),
                ("added", self.changes.added),
                ("removed", self.changes.removed),
            )
            if paths
        ]
        files = "; ".join(parts) if parts else "no file differs"
        return (
            f"{name}: {where} moved from {self.old_sha[:12] or 'unpinned'} to {self.new_sha[:12]} ({files})."
        )


def model_hub_check(*, model: Model) -> HubUpdate:
    """Resolve the model's revision again and compare it with its pin; changes nothing.

    Raises:
        ValidationError: the model is not a hub model, or the hub refuses (as for `hub_pin`).
    """
    if model.source_kind != ModelInstance.SourceKind.HUB:
        raise ValidationError(f"{model.name} is a local folder: it has no hub revision to check.")
    repo, revision = model.hf_repo, model.hf_revision
    new = hub_commit(repo=repo, revision=revision)
    if not model.hf_sha or model.hf_sha == new.sha:
        old = new if model.hf_sha else HubCommit(repo, revision, "", ())
    else:
        old = hub_commit(repo=repo, revision=model.hf_sha)
    return HubUpdate(model, revision, model.hf_sha, new.sha, hub_changes(old, new))


def _pinned_for(model: Model) -> tuple[str, str] | None:
    """The (repo, revision) the model's `hf_sha` was resolved for: this process's resolve, or the
    saved row's source when the pin is the saved one."""
    if model.hub_pinned_for is not None:
        return model.hub_pinned_for
    if model.pk is None:
        return None
    row = Model.objects.filter(pk=model.pk).values_list("hf_repo", "hf_revision", "hf_sha").first()
    if row is None or row[2] != model.hf_sha:
        return None
    return row[0].strip(), row[1].strip()
