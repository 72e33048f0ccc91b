"""Reading an answer back: generated text -> answer, reasoning and tool-call events (loop side).

`AnswerReader` follows an `AnswerPlan` (structure.py). The model's own markers (thinking, its
tool-call format) are found by the backend's `TextSplitter` (mlx-lm's text state machine and tool
parsers on the real backend), so raw markup never reaches the answer text.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from mlxhost.engine.types import Delta, Done, ReasoningDelta, ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.structure import AnswerPlan
    from mlxhost.engine.types import Event, Tool

# The parts of a streamed call's arguments, as OpenAI streams them: a few characters at a time.
ARGUMENT_PIECE = 32


class TextSplitter(Protocol):
    """A model's markers in its output: text is "normal", "reasoning" or inside a "tool" call."""

    def split(self, text: str) -> list[tuple[str, str]]:
        """(state, text) pieces of `text`, markers removed; a possible marker's start is held back."""
        ...

    def flush(self) -> list[tuple[str, str]]:
        """What is held back, at the end of the answer."""
        ...

    def parse_calls(self, text: str, tools: tuple[Tool, ...]) -> list[tuple[str, str]]:
        """(name, arguments JSON text) of the calls in one tool segment.

        Raises:
            ValueError: the segment is not a call the model's parser can read.
        """
        ...


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def new_call_id(prefix: str = "call_") -> str:
    """A fresh tool call id in the surface's provider's form (`call_…`, `toolu_…`)."""
    return f"{prefix}{secrets.token_hex(12)}"


class AnswerReader:
    """Turns the engine's answer Deltas into Delta / ReasoningDelta / ToolCallDelta events."""

    def __init__(
        self,
        plan: AnswerPlan,
        splitter: TextSplitter | None,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._plan = plan
        self._splitter = splitter if plan.mode in ("text", "json", "native") else None
        self._new_id = new_id
        self._state = "normal"
        self._segment: list[str] = []  # a tool segment (native) or the whole call (call, choice)
        self._calls: list[ToolCall] = []
        self._reasoning: list[str] = []
        self._mode = plan.mode  # "choice" becomes "text" or "call" at its first character
        self._args_id: str | None = None

    def feed(self, delta: Delta) -> list[Event]:
        if self._mode == "choice" and delta.text:
            self._mode = "call" if delta.text[0] == (self._plan.call_prefix or "{")[0] else "text"
        if self._mode == "args":
            return self._args(delta.text)
        if self._mode in ("call", "choice"):
            self._segment.append(delta.text)
            return []
        if self._splitter is None:
            return [delta] if delta.text or delta.token_ids else []
        return self._pieces(self._splitter.split(delta.text), delta)

    def finish(self, done: Done) -> list[Event]:
        """The events still held back, then `done` with the answer's calls and reasoning."""
        events: list[Event] = []
        if self._splitter is not None:
            events += self._pieces(self._splitter.flush(), None)
            events += self._end_segment()
        elif self._mode == "call":
            events += self._whole_call(done)
        elif self._mode == "args" and self._args_id is None and done.finish_reason == "stop":
            events += self._args("")
        if self._mode == "args" and self._args_id is not None:
            arguments = "".join(self._segment)
            if done.finish_reason != "stop" or _is_json(arguments):
                self._calls = [ToolCall(self._args_id, self._plan.forced or "", arguments)]
            # else a stop string cut the arguments: not a call, and the answer ends as it stopped
        finish = done.finish_reason
        if self._calls and finish == "stop":
            finish = "tool_calls"
        reasoning = "".join(self._reasoning)
        events.append(replace(done, finish_reason=finish, tool_calls=tuple(self._calls), reasoning=reasoning))
        return events

    def _args(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._args_id is None:
            self._args_id = self._new_id()
            events.append(ToolCallDelta(0, id=self._args_id, name=self._plan.forced))
        if text:
            self._segment.append(text)
            events.append(ToolCallDelta(0, arguments=text))
        return events

    def _pieces(self, pieces: list[tuple[str, str]], delta: Delta | None) -> list[Event]:
        events: list[Event] = []
        answered = False
        for state, text in pieces:
            if state != "tool":
                events += self._end_segment()
            self._state = state
            if state == "tool":
                self._segment.append(text)
            elif state == "reasoning":
                if text:
                    self._reasoning.append(text)
                    events.append(ReasoningDelta(text))
            elif text:
                # The token ids (and logprobs) ride with the first answer text of the Delta.
                if delta is not None and not answered:
                    events.append(replace(delta, text=text))
                    answered = True
                else:
                    events.append(Delta(text))
        if delta is not None and not answered and delta.token_ids:
            events.append(replace(delta, text=""))
        return events

    def _end_segment(self) -> list[Event]:
        if self._state != "tool" or self._splitter is None:
            return []
        text, self._segment = "".join(self._segment), []
        self._state = "normal"
        if not self._plan.tools:  # the model called although nothing was offered: keep it as text
            return [Delta(text)] if text else []
        try:
            calls = self._splitter.parse_calls(text, self._plan.tools)
        except (ValueError, KeyError, TypeError):
            return [Delta(text)] if text else []  # never a broken call: what it wrote stays text
        return self._emit_calls(calls)

    def _whole_call(self, done: Done) -> list[Event]:
        text, self._segment = "".join(self._segment), []
        try:
            value = json.loads(text.removeprefix(self._plan.call_prefix))
            calls = [(str(value["name"]), json.dumps(value["arguments"], ensure_ascii=False))]
        except (ValueError, KeyError, TypeError):
            # Cut short (max_tokens) before the object closed: it is reported as text.
            return [Delta(text)] if text else []
        return self._emit_calls(calls)

    def _emit_calls(self, calls: list[tuple[str, str]]) -> list[Event]:
        events: list[Event] = []
        for name, arguments in calls:
            if self._plan.single and self._calls:
                break  # parallel calls are off: the first call is the answer's only one
            index, call_id = len(self._calls), self._new_id()
            self._calls.append(ToolCall(call_id, name, arguments))
            events.append(ToolCallDelta(index, id=call_id, name=name))
            for start in range(0, len(arguments), ARGUMENT_PIECE):
                events.append(ToolCallDelta(index, arguments=arguments[start : start + ARGUMENT_PIECE]))
        return events
