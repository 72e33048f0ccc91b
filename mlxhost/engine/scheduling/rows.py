"""A request's choices in one batch (OpenAI `n` > 1): their prompt prefilled once, lent to the rows.

The first row (`RowGroup.index` 0) starts from the prefix cache as any request does, feeds the
rest of the prompt but its last token (`LoadedModel.prefill`), and keeps a copy of that cache
for the group's other rows while it runs. Each of them starts from its own copy (the last one
takes the kept cache itself), so the batch feeds it the prompt's last token alone and samples
from there with its own seed. A row that joins after the first has ended, or a group whose first
row could not keep a copy, starts the ordinary way (the prefix cache may then serve it).
Worker thread only, like the `Batch` that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.jobs import GenerateJob


@dataclass(slots=True)
class _Lent:
    kv: object  # holds exactly `tokens`, which no row's own cache ever is
    tokens: tuple[int, ...]
    left: int  # rows still to take it
    owner: int  # the batch handle of the row that prefilled it


class SharedPrompts:
    """The prompts kept for groups whose later rows have not joined yet, by group key."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._lent: dict[str, _Lent] = {}
        self._pending: tuple[str, _Lent] | None = None  # prefilled by `start_kv`, kept by `adopt`

    def __len__(self) -> int:
        return len(self._lent)

    def start_kv(self, job: GenerateJob) -> tuple[object | None, int, int]:
        """The cache `job` starts from, how many prompt tokens it holds, and how many of them
        count as cached (its usage): `GenerateJob.start_kv` for a job that is no group's row.
        The first row's prompt was computed for it, so only the prefix cache's part counts."""
        rows, model, prompt = job.rows, self.model, job.prompt_ids
        if rows is None or rows.size < 2 or model.shared_cache:
            kv, reuse = job.start_kv(model)
            return kv, reuse, reuse
        lent = self._lent.get(rows.key)
        if rows.index > 0 and lent is not None and tuple(prompt[: len(lent.tokens)]) == lent.tokens:
            held = len(lent.tokens)
            return self._take(rows.key, lent), held, held
        kv, reuse = job.start_kv(model)
        shared = len(prompt) - 1
        if rows.index > 0 or shared <= reuse:
            return kv, reuse, reuse  # nothing left to share beyond what the prefix cache gave
        kv = model.prefill(kv, prompt[reuse:shared], job.adapter)
        copy = model.copy_cache(kv, shared)
        if copy is not None:
            self._pending = (rows.key, _Lent(copy, tuple(prompt[:shared]), rows.size - 1, -1))
        return kv, shared, reuse

    def adopt(self, handle: int) -> None:
        """The first row is in the batch as `handle`: keep its copy for the others until it ends."""
        if self._pending is not None:
            key, lent = self._pending
            self._pending = None
            lent.owner = handle
            old = self._lent.pop(key, None)
            if old is not None:
                self.model.dispose_cache(old.kv)
            self._lent[key] = lent

    def discard_pending(self) -> None:
        """The first row's insert failed after `start_kv`: its copy goes."""
        if self._pending is not None:
            self.model.dispose_cache(self._pending[1].kv)
            self._pending = None

    def ended(self, handle: int) -> None:
        """The row `handle` left the batch: a copy it kept goes (later rows start on their own)."""
        for key, lent in list(self._lent.items()):
            if lent.owner == handle:
                del self._lent[key]
                self.model.dispose_cache(lent.kv)

    def close(self) -> None:
        self.discard_pending()
        for lent in self._lent.values():
            self.model.dispose_cache(lent.kv)
        self._lent.clear()

    def _take(self, key: str, lent: _Lent) -> object:
        lent.left -= 1
        if lent.left > 0:
            copy = self.model.copy_cache(lent.kv, len(lent.tokens))
            if copy is not None:
                return copy
        del self._lent[key]  # the last row takes the kept cache itself
        return lent.kv
