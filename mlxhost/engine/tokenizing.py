"""Bounded work before admission: templating and tokenizing run in a small pool of their own, and a
prompt too long in characters to fit is refused before any of that starts.

A template render or a tokenization holds the whole prompt and its token ids (a few bytes per
token on top of the text); run for every arrival at once they add up to gigabytes (issue 25:
eight concurrent 4 MiB `count_tokens` bodies raised the peak by 2.9 GB). So they run in at most
`size` threads, whatever the surface (chat, completions, Responses, Messages, `count_tokens`, the
WebSocket, embeddings); the rest wait in line, holding only their request. A waiter whose
caller gives up is dropped from the line without running.

The character bound (`fits_in_characters`) is sound: a token never covers more characters of the
text than the longest entry of its tokenizer's vocabulary has (`chars_per_token`, which a model
reports; a normalizer that composes characters, NFC or NFKC, may fold up to four into one, and the
model's figure includes that). So a text of more than `chars_per_token` x the token limit
characters is over the limit, without tokenizing it.
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.types import GenerationRequest

T = TypeVar("T")


class TokenizePool:
    """At most `size` renders or tokenizations at once, in threads of their own (`mlxhost-tokenize`).

    `running` and `waiting` say what it holds now (any thread may read them); `peak` is the most
    that ever ran at once.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("The tokenize pool needs at least one thread.")
        self.size = size
        self._pool = ThreadPoolExecutor(size, thread_name_prefix="mlxhost-tokenize")
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.peak = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the pool. Cancelling the caller drops a call that has not
        started; one already running finishes in its thread (and still holds its place till then).
        """
        with self._lock:
            self.waiting += 1
        try:
            future = self._pool.submit(self._call, fn, *args)
        except BaseException:
            with self._lock:
                self.waiting -= 1
            raise
        future.add_done_callback(self._settled)
        return await asyncio.wrap_future(future)

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            self.waiting -= 1
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.running -= 1

    def _settled(self, future: object) -> None:
        # A call cancelled before it started never ran `_call`: it leaves the line here.
        if getattr(future, "cancelled", lambda: False)():
            with self._lock:
                self.waiting -= 1

    def close(self) -> None:
        """Drop the calls that have not started; running ones finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def request_characters(request: GenerationRequest) -> int:
    """The characters of text `request` sends for its prompt: the raw prompt, or every message's
    content and tool-call arguments (what the template renders around them only adds tokens)."""
    if request.prompt is not None:
        return len(request.prompt)
    return sum(
        len(m.content) + sum(len(c.arguments) + len(c.name) for c in m.tool_calls) for m in request.messages
    )


def fewest_tokens(characters: int, chars_per_token: int) -> int:
    """The fewest tokens `characters` of text can be, when no token covers more than
    `chars_per_token` characters."""
    return math.ceil(characters / chars_per_token)


def fits_in_characters(characters: int, *, chars_per_token: int, limit: int | None) -> bool:
    """False when `characters` of text cannot fit in `limit` tokens; True when it may (or when the
    model does not say how many characters its tokens cover: `chars_per_token` 0)."""
    return not (chars_per_token and limit is not None and characters > chars_per_token * limit)


def nonspace_characters(text: str) -> int:
    """`text`'s characters that are not whitespace: an encoder that splits words on whitespace
    (BERT's WordPiece) drops the rest before it makes a token. Counted without copying `text`."""
    return len(text) - sum(text.count(space) for space in WHITESPACE)


# Every character `str.isspace()` calls whitespace (what `str.split()` drops).
WHITESPACE = tuple(chr(c) for c in range(0x3001) if chr(c).isspace())
