"""Constrained decoding with llguidance, token bytes for logprobs, and the model's output markers.

llguidance (benchmarks/README.md, "Grammar engines") compiles a JSON schema or a Lark grammar
against the model's vocabulary; a per-sequence logits processor then masks every token the
grammar does not allow next. The processor runs inside mlx-lm's `stream_generate` and
`BatchGenerator` alike, so a constrained request shares a batch (and a cached prefix) with any
other. Compiled grammars are kept per model (LRU) and copied per request.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
from mlx_lm.generate import TextStateMachine, make_text_state_machine

from mlxhost.engine.errors import GrammarFailedError, InvalidRequestError
from mlxhost.engine.structure import template_tools
from mlxhost.engine.types import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mlxhost.engine.types import Grammar, Tool

COMPILED_GRAMMARS = 64  # per model
REFUSED_GRAMMARS = 256  # per model: refusals remembered, so a repeated bad schema costs nothing
# Steps walked on a fresh grammar before it is admitted: llguidance fails some schemas only
# once it computes masks (an unbounded recursion, a regex that explodes, `{"$ref": "#"}`).
WALK_STEPS = 8
# Bounds on one grammar's size and on the work of one mask, so a hostile schema is refused or
# cut off, never a hang (llguidance's fuel; its defaults are 500k symbols and 200k fuel a step).
# The first mask gets no more fuel than a later step: with llguidance's 1M, the pattern
# `^a{1000}{1000}$` burned 5.7 s of CPU in its regex builder before it was refused; with 200k,
# 1.6 s (tiny llama, 2 busy cores). Schemas with 1000-value enums, 40 nested arrays, date-times
# and `a{100}{100}` compile as before.
LIMITS: dict[str, Any] = {
    "max_grammar_size": 200_000,
    "step_lexer_fuel": 200_000,
    "initial_lexer_fuel": 200_000,
}
# Compact JSON: a free run of whitespace would let a model wander in blank space until max_tokens.
JSON_OPTIONS: Any = {"whitespace_flexible": False}


class Vocabulary:
    """The model's tokenizer as llguidance sees it (built on first use, about a second), its
    compiled grammars, and each token's exact bytes."""

    def __init__(self, tokenizer: Any, logits_size: int) -> None:
        self._tokenizer = tokenizer
        self.logits_size = logits_size
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()  # key -> why
        self._lock = threading.Lock()  # loop-side checks and the worker share the cache

    @property
    def ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                eos = sorted(self._tokenizer.eos_token_ids)
                self._ll = llguidance.hf.from_tokenizer(hf, n_vocab=self.logits_size, eos_token=eos)
            return self._ll

    def check(self, grammar: Grammar, param: str) -> llguidance.LLMatcher:
        """The compiled matcher of `grammar` (compiled, walked and cached on first use).

        Raises:
            InvalidRequestError: naming `param`: the grammar does not compile, or fails within
                its first WALK_STEPS steps (then it is remembered as refused, never cached).
        """
        key = (grammar.kind, grammar.source)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None and not compiled.is_error():
                self._compiled.move_to_end(key)
                return compiled
            self._compiled.pop(key, None)
            refused = self._refused.get(key)
        if refused is not None:
            raise InvalidRequestError(param, refused)
        try:
            compiled = self._compile(grammar)
            _walk(compiled.deep_copy(), self.logits_size, set(self.ll.eos_tokens))
        except _Refused as refusal:
            with self._lock:
                self._refused[key] = refusal.why
                while len(self._refused) > REFUSED_GRAMMARS:
                    self._refused.popitem(last=False)
            raise InvalidRequestError(param, refusal.why) from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar` (see `check`).

        Raises:
            InvalidRequestError: the grammar cannot be served.
        """
        return self.check(grammar, "response_format").deep_copy()

    def forget(self, grammar: Grammar) -> None:
        """Drop `grammar` from the cache: a matcher of it failed while generating."""
        with self._lock:
            self._compiled.pop((grammar.kind, grammar.source), None)

    def _compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        try:
            text = (
                llguidance.LLMatcher.grammar_from_json_schema(grammar.source, defaults=JSON_OPTIONS)
                if grammar.kind == "json"
                else llguidance.LLMatcher.grammar_from_lark(grammar.source)
            )
        except ValueError as exc:
            raise _Refused(f"the schema is not valid JSON: {exc}") from None
        limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)
        matcher = llguidance.LLMatcher(self.ll, text, log_level=0, limits=limits)
        if matcher.is_error():
            raise _Refused(f"the schema cannot be enforced: {_short(matcher.get_error())}")
        return matcher

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.ll.decode_bytes([token]))

    def logprob(self, logprobs: mx.array, token: int, top: int) -> TokenLogprob:
        """`token`'s log probability in the `logprobs` row and the `top` most likely tokens."""
        row = logprobs.reshape(-1)
        alternatives: tuple[TopLogprob, ...] = ()
        if top:
            best = mx.argpartition(-row, kth=top - 1)[:top]
            values = row[best]
            order = mx.argsort(-values)
            ids = cast("list[int]", best[order].tolist())
            lps = cast("list[float]", values[order].tolist())
            # Tokens a grammar masked have -inf: no alternative at all, and not JSON.
            alternatives = tuple(
                self._top(i, lp) for i, lp in zip(ids, lps, strict=True) if math.isfinite(lp)
            )
        raw = self.token_bytes(token)
        chosen = cast("float", row[token].item())
        return TokenLogprob(raw.decode("utf-8", "replace"), tuple(raw), chosen, alternatives)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        raw = self.token_bytes(token)
        return TopLogprob(raw.decode("utf-8", "replace"), tuple(raw), logprob)


class GrammarProcessor:
    """An mlx-lm logits processor that keeps one sequence inside its grammar.

    mlx-lm calls it once per sampled token: first with the prompt (nothing sampled yet), then
    with the sampled tokens appended; each later call first commits the token sampled last.
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, logits_size: int, forget: Callable[[], None] = lambda: None
    ) -> None:
        self._matcher = matcher
        self._size = logits_size
        self._forget = forget  # drops the compiled grammar from the cache when a step fails
        self._started = False
        # One bit per token, filled in place: about half the time of `compute_logit_bias`, which
        # returns a fresh byte per token (benchmarks/RESULTS.md, "Grammar budget at batch 8").
        self._bits = llguidance.numpy.allocate_token_bitmask(1, logits_size)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        matcher = self._matcher
        if self._started and not matcher.consume_token(cast("int", tokens[-1].item())):
            self._forget()
            raise GrammarFailedError(f"the sampled token broke the grammar: {_short(matcher.get_error())}")
        self._started = True
        llguidance.numpy.fill_next_token_bitmask(matcher, self._bits)
        if matcher.is_error():
            # An errored matcher allows only EOS: that would end the answer "stop", unfinished.
            self._forget()
            raise GrammarFailedError(f"the grammar failed: {_short(matcher.get_error())}")
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._size].view(np.bool_)
        return mx.where(mx.array(mask), logits, mx.array(-float("inf"), dtype=logits.dtype))


class MlxSplitter:
    """mlx-lm's text state machine (thinking and tool-call markers) and the model's tool parser."""

    def __init__(self, machine: TextStateMachine, initial: str, parser: Any) -> None:
        self._state = machine.make_state(initial)
        self._parser = parser

    def split(self, text: str) -> list[tuple[str, str]]:
        self._state, segments = TextStateMachine.split(self._state, text)
        return [(state or "normal", piece) for state, piece in segments]

    def flush(self) -> list[tuple[str, str]]:
        self._state, held, state = TextStateMachine.flush(self._state)
        return [(state or "normal", held)]

    def parse_calls(self, text: str, tools: tuple[Tool, ...]) -> list[tuple[str, str]]:
        if self._parser is None:
            raise ValueError("this model has no tool parser")
        parsed = self._parser(text, template_tools(tools))
        calls = parsed if isinstance(parsed, list) else [parsed]
        return [(str(call["name"]), _arguments_text(call.get("arguments", {}))) for call in calls]


def splitter_for(
    tokenizer: Any, machine: TextStateMachine | None, prompt_ids: Sequence[int]
) -> MlxSplitter | None:
    """A splitter for an answer to `prompt_ids`, starting inside a thinking block when the
    prompt opened one (as mlx-lm's server decides)."""
    if machine is None:
        return None
    initial = "normal"
    if tokenizer.has_thinking:
        prompt = list(prompt_ids)
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            initial = "reasoning"
    initial = tokenizer.response_initial_state or initial
    return MlxSplitter(machine, initial, tokenizer.tool_parser)


def state_machine(tokenizer: Any) -> TextStateMachine | None:
    """The model's marker state machine; None when it has neither thinking nor tool markers."""
    if not tokenizer.has_thinking and not tokenizer.has_tool_calling:
        return None
    machine: TextStateMachine = make_text_state_machine(tokenizer)
    return machine


def tool_markers(tokenizer: Any, vocabulary: Vocabulary) -> tuple[str, str] | None:
    """The model's call markers as Lark terms (a special token by id, else the literal text),
    when its calls are JSON between them (mlx-lm's json_tools parser); None otherwise."""
    parser = tokenizer.tool_parser if tokenizer.has_tool_calling else None
    if parser is None or not getattr(parser, "__module__", "").endswith(".json_tools"):
        return None
    return (
        _marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens, vocabulary),
        _marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens, vocabulary),
    )


def _marker(text: str, tokens: Sequence[int] | None, vocabulary: Vocabulary) -> str:
    if tokens is not None and len(tokens) == 1 and vocabulary.ll.is_special_token(tokens[0]):
        return f"<[{tokens[0]}]>"
    return json.dumps(text)


class _Refused(Exception):
    """A grammar that cannot be served; `why` is the client's message."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _walk(matcher: llguidance.LLMatcher, logits_size: int, eos: set[int]) -> None:
    # A few steps along the lowest allowed token, as generation will take them.
    bits = llguidance.numpy.allocate_token_bitmask(1, logits_size)
    for _ in range(WALK_STEPS):
        llguidance.numpy.fill_next_token_bitmask(matcher, bits)
        if matcher.is_error():
            raise _Refused(f"the schema cannot be enforced: {_short(matcher.get_error())}")
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:logits_size])
        tokens = [int(t) for t in allowed if int(t) not in eos]
        if not tokens:
            if len(allowed):
                return  # complete: only the end is left
            raise _Refused("the schema allows no answer.")
        if not matcher.consume_token(tokens[0]):
            raise _Refused(f"the schema cannot be enforced: {_short(matcher.get_error())}")


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _short(error: str) -> str:
    return error.strip().splitlines()[0][:300] if error.strip() else "unknown error"
