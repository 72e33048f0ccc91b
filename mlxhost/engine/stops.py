"""Text stop sequences: hold back what could still become a stop string, cut at the first match."""

from __future__ import annotations

# What a detokenizer's final flush shows for bytes that never became a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class StopMatcher:
    """Feeds streamed text through, withholding any suffix that may start a stop sequence.

    `feed(text)` returns `(safe_text, stopped)`: text that can be sent now, and whether a
    stop sequence completed (the stop string itself is never emitted). `flush()` returns
    the withheld tail when generation ends without a match. `matched` names the stop
    sequence that completed (the earliest in the text), for APIs that report it.

    A trailing U+FFFD is withheld too, with or without stops: it goes out with the text that
    follows it, and `flush()` drops it. Streaming detokenizers hold back an incomplete UTF-8
    sequence and only their final flush decodes it, as exactly one U+FFFD at the very end, so an
    answer cut mid-character (by max_tokens, or EOS) never ends with a partial character. Any
    U+FFFD before that one stands for invalid bytes the model did write, and stays.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None
        self._longest = max((len(s) for s in self._stops), default=0)

    def feed(self, text: str) -> tuple[str, bool]:
        buffer = self._held + text
        if not self._stops and not buffer.endswith(REPLACEMENT):
            self._held = ""
            return buffer, False
        found = [(i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda hit: hit[0])
            self._held = ""
            return buffer[:cut], True
        keep = max(self._partial_suffix(buffer), int(buffer.endswith(REPLACEMENT)))
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The withheld tail at the end of generation, less the U+FFFD of a cut character."""
        held, self._held = self._held, ""
        return held.removesuffix(REPLACEMENT)

    def _partial_suffix(self, buffer: str) -> int:
        # Longest suffix of `buffer` that is a proper prefix of some stop string.
        for size in range(min(self._longest - 1, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0
