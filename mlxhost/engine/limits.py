"""Per-request limits checked against the loaded model before a request is admitted.

Every value here reaches MLX, which does no bounds checks of its own: a logit bias for a token
id outside the vocabulary writes out of bounds, and a `top_k` at or above the vocabulary size
raises inside a compiled sampler and leaves MLX's global random state broken for every later
request (MLX-NOTES.md). So nothing reaches a worker thread before it passed these checks.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from mlxhost.engine.errors import InvalidRequestError, PromptTooLongError, RequestTooLargeError
from mlxhost.engine.tokenizing import fewest_tokens, fits_in_characters

if TYPE_CHECKING:
    from mlxhost.engine.types import SamplingParams

MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API allows
MAX_BIAS = 100.0
MAX_SEED = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
# (field, lowest, highest): the ranges every surface's serializer also enforces; these catch alias
# defaults and anything a caller built by hand.
_RANGES: tuple[tuple[str, float, float], ...] = (
    ("temperature", 0.0, 2.0),
    ("top_p", 0.0, 1.0),
    ("min_p", 0.0, 1.0),
    ("repetition_penalty", 0.01, 10.0),
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's choice `index` (OpenAI `n`, docs/api.md): the request's seed plus
    the index, wrapping past MAX_SEED, so the same request gives the same choices again and its
    first choice is what the request with `n` = 1 gives. No seed: each choice draws freely."""
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


def checked_sampling(sampling: SamplingParams, *, vocab_size: int) -> SamplingParams:
    """`sampling` made safe for a model with `vocab_size` tokens.

    A `top_k` at or above the vocabulary keeps every token, so it becomes 0 (off), which
    samples from the same distribution without tripping mlx-lm's range check.

    Raises:
        InvalidRequestError: a value no model could use, or a token id outside this vocabulary.
    """
    for name, low, high in _RANGES:
        value = getattr(sampling, name)
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise InvalidRequestError(name, f"must be a number from {low:g} to {high:g}.")
    if sampling.top_k < 0:
        raise InvalidRequestError("top_k", "must be 0 (off) or a positive integer.")
    if sampling.max_tokens < 0:
        raise InvalidRequestError("max_tokens", "must not be negative.")
    if sampling.seed is not None and not 0 <= sampling.seed <= MAX_SEED:
        raise InvalidRequestError("seed", f"must be an integer from 0 to {MAX_SEED}.")
    _check_logit_bias(sampling.logit_bias, vocab_size)
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS}.")
    if sampling.top_k >= vocab_size:
        sampling = replace(sampling, top_k=0)
    return sampling


def _check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids.")
    for token, value in bias:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                "logit_bias", f"token id {token} is outside this model's vocabulary (0 to {vocab_size - 1})."
            )
        if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
            raise InvalidRequestError(
                "logit_bias", f"biases must be numbers from {-MAX_BIAS:g} to {MAX_BIAS:g}."
            )


def input_limit(alias_limit: int | None, context_length: int | None) -> int | None:
    """The most prompt tokens a request may send: the model's context (less one token for the
    answer), lowered by the alias's `max_input_tokens`; None when neither is known."""
    limits = [n for n in (alias_limit, context_length - 1 if context_length else None) if n]
    return min(limits) if limits else None


def check_prompt_characters(characters: int, *, chars_per_token: int, limit: int | None) -> None:
    """Refuse a prompt whose text alone is too long to fit, before it is rendered or tokenized
    (a token covers at most `chars_per_token` characters; 0: unknown, nothing refused here).

    Raises:
        PromptTooLongError: more than `chars_per_token` x `limit` characters; its token count is
            the fewest those characters can be (`at_least`).
    """
    if not fits_in_characters(characters, chars_per_token=chars_per_token, limit=limit):
        assert limit is not None
        raise PromptTooLongError(fewest_tokens(characters, chars_per_token), limit, at_least=True)


def fitted(
    sampling: SamplingParams,
    prompt_tokens: int,
    *,
    alias_limit: int | None,
    context_length: int | None,
) -> SamplingParams:
    """Check the prompt's length and cut `max_tokens` to what the context has room for.

    Raises:
        PromptTooLongError: the prompt is over the input limit (see `input_limit`).
    """
    limit = input_limit(alias_limit, context_length)
    if limit is not None and prompt_tokens > limit:
        raise PromptTooLongError(prompt_tokens, limit)
    if context_length and prompt_tokens + sampling.max_tokens > context_length:
        sampling = replace(sampling, max_tokens=max(context_length - prompt_tokens, 1))
    return sampling


def check_kv_cost(tokens: int, *, bytes_per_token: int, budget_bytes: int | None) -> None:
    """Refuse a request whose KV cache (prompt plus max_tokens) could never fit in memory.

    Raises:
        RequestTooLargeError: the estimate is over `budget_bytes`.
    """
    needed = tokens * bytes_per_token
    if budget_bytes is not None and bytes_per_token and needed > budget_bytes:
        raise RequestTooLargeError(needed, budget_bytes)


def physical_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
