"""Whether a draft model can draft for a target: the two tokenizers must share one vocabulary.

Speculative decoding feeds the target the draft's token ids as they are, so both must mean the
same text by every id. mlx-lm's server compares the two tokenizers' `vocab_size` when it loads a
draft; here the vocabularies themselves are compared (every token and its id, added tokens
included), which also catches two tokenizers of one size that number their tokens differently.
The embedding matrices may still differ in size (rows past the vocabulary, padding, are
never a token of either). Pure Python: the admin reads a folder's `tokenizer.json`, the backend
its loaded tokenizers, and both ask `vocabulary_mismatch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


def folder_vocabulary(folder: Path) -> dict[str, int] | None:
    """The vocabulary of a model folder's `tokenizer.json` (added tokens included); None when
    the folder has none (a slow tokenizer: only loading it tells, which the backend does)."""
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return dict(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True))


def vocabulary_mismatch(target: Mapping[str, int], draft: Mapping[str, int]) -> str | None:
    """Why a draft with vocabulary `draft` cannot draft for `target`, in one sentence; None
    when they are the same."""
    if len(target) != len(draft):
        return (
            f"The draft model's vocabulary has {len(draft)} tokens and the model's {len(target)}: "
            "a draft must use the same tokenizer."
        )
    differing = sorted(token for token, index in target.items() if draft.get(token) != index)
    if differing:
        sample = ", ".join(repr(token) for token in differing[:3])
        return (
            f"The draft model's tokenizer numbers {len(differing)} tokens differently ({sample}): "
            "a draft must use the same tokenizer."
        )
    return None
