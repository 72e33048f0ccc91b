"""The exact streaming detokenizer: generated text that continues the prompt's text to the character.

mlx-lm's streaming detokenizers (BPE and SPM) drop a leading space from the first segment they
write, so a continuation (`/v1/completions`, an Anthropic prefill) lost the space between the
prompt and its first word ("1, 2, 3," then "4," instead of " 4,"). This one decodes a short
window of tokens that starts inside the prompt, and writes only what the new tokens add to that
window's text (the incremental decoding of vLLM and Hugging Face TGI). Whatever the tokenizer does
at the start of a text (SPM's leading "▁", a BOS) happens inside the window, so `prompt text +
generated text` is exactly the decoding of `prompt ids + generated ids`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mlxhost.engine.types import TokenLogprob

# Prompt tokens the window starts with: enough context for any tokenizer's merge of a word start
# (vLLM primes with 5 as well).
PRIME_TOKENS = 5
REPLACEMENT = "\ufffd"


class ExactDetokenizer:
    """One sequence's text, token by token; `add_token` returns the text that token completes.

    A token that ends inside a multi-byte character adds nothing yet: the character goes out with
    the token that completes it, so the segments join to exactly the decoded text. `finalize`
    writes what is still held (an incomplete character decodes as U+FFFD there, as mlx-lm's do).
    """

    __slots__ = ("_decode", "_read", "_tokens")

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF tokenizer
        self._decode = hf.decode
        self._tokens = [int(t) for t in context[-PRIME_TOKENS:]]
        # The window: `_tokens[:_read]` are written already (its context), the rest are not yet.
        self._read = len(self._tokens)

    def add_token(self, token: int) -> str:
        self._tokens.append(int(token))
        return self._segment(final=False)

    def finalize(self) -> str:
        return self._segment(final=True)

    def _segment(self, *, final: bool) -> str:
        if self._read >= len(self._tokens):
            return ""
        before = self._text(self._tokens[: self._read])
        after = self._text(self._tokens)
        if not final and after.endswith(REPLACEMENT):
            return ""  # inside a character: wait for the token that completes it
        # Past the window's first token decoding is a concatenation: `after` starts with `before`.
        segment = after[len(before) :]
        # The tokens just written are the next window's context; older ones are dropped.
        del self._tokens[: self._read]
        self._read = len(self._tokens)
        return segment

    def _text(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text: str = self._decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text


def spelled(logprob: TokenLogprob | None, segment: str) -> TokenLogprob | None:
    """`logprob` with the text its token added as its `token`, so the tokens join to the text.

    A token's own bytes can be part of a character (the `bytes` field keeps them): it then reads
    "" and the token that completes the character reads the whole character.
    """
    if logprob is None or logprob.token == segment:
        return logprob
    return dataclasses.replace(logprob, token=segment)
