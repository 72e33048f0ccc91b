"""Continuous batching on mlx-lm's `BatchGenerator`: the mlx `BatchRunner`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxhost.engine.backends.base import BatchStep, SequenceCache

if TYPE_CHECKING:
    from mlxhost.engine.types import SamplingParams

# Sequences prefilled together; more would make a long prompt's arrival stall every stream longer.
PREFILL_BATCH = 8
_SAMPLER_MEMO = 64


def make_processors(sampling: SamplingParams) -> list[Any]:
    """mlx-lm logits processors for `sampling`: logit bias and the three penalties."""
    return make_logits_processors(
        logit_bias=dict(sampling.logit_bias) or None,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )


class MlxBatch:
    """A `BatchGenerator` plus one streaming detokenizer per sequence; worker thread only.

    The generator stops a sequence on the model's EOS tokens ("stop", not shown or counted,
    as `stream_generate` does); text stop strings are the worker's. Every returned token has
    already been fed, so a finished sequence's cache holds prompt + generated (+ EOS), and
    `all_tokens` (seeded with the cached prefix) lists exactly those tokens.
    """

    def __init__(self, model: Any, tokenizer: Any, capacity: int) -> None:
        self.capacity = capacity
        self._tokenizer = tokenizer
        eos = sorted(tokenizer.eos_token_ids)
        self._generator = BatchGenerator(
            model,
            stop_tokens=[[token] for token in eos] or None,
            completion_batch_size=capacity,
            prefill_batch_size=min(capacity, PREFILL_BATCH),
        )
        self._detokenizers: dict[int, Any] = {}
        self._samplers: dict[tuple[float, float, float, int], Any] = {}

    def accepts(self, sampling: SamplingParams) -> bool:
        # The batch samples from MLX's one global RNG, so a per-request seed cannot be honoured
        # (mlx_lm.server serves seeded requests alone too).
        return sampling.seed is None

    def insert(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, kv: object | None, cached: int
    ) -> int:
        (uid,) = self._generator.insert(
            [list(prompt_ids[cached:])],
            max_tokens=[sampling.max_tokens],
            caches=[kv],  # None: the generator makes a fresh cache
            all_tokens=[list(prompt_ids[:cached])],
            samplers=[self._sampler(sampling)],
            logits_processors=[make_processors(sampling)],
        )
        self._detokenizers[uid] = self._tokenizer.detokenizer
        return int(uid)

    def step(self) -> list[BatchStep]:
        # next(), not next_generated(): one decode step plus one prefill chunk, so arrivals and
        # cancels are handled between chunks of a long prompt.
        _, responses = self._generator.next()
        steps = []
        for response in responses:
            detokenizer = self._detokenizers[response.uid]
            finish = response.finish_reason
            token: int | None = int(response.token)
            if finish == "stop":  # an EOS token: finish the text, neither show nor count the token
                token = None
            else:
                detokenizer.add_token(response.token)
            cache = None
            if finish is not None:
                detokenizer.finalize()
                del self._detokenizers[response.uid]
                cache = SequenceCache(response.prompt_cache, tuple(response.all_tokens))
            steps.append(BatchStep(response.uid, detokenizer.last_segment, token, finish, cache))
        return steps

    def remove(self, handle: int) -> SequenceCache:
        caches = self._generator.remove([handle], return_prompt_caches=True)
        self._detokenizers.pop(handle, None)
        kv, tokens = caches[handle]
        return SequenceCache(kv, tuple(tokens))

    def close(self) -> None:
        self._detokenizers.clear()
        self._generator.close()

    def _sampler(self, sampling: SamplingParams) -> Any:
        # Sequences holding the same sampler object are sampled in one batched call.
        key = (sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k)
        sampler = self._samplers.get(key)
        if sampler is None:
            if len(self._samplers) >= _SAMPLER_MEMO:
                self._samplers.clear()
            sampler = make_sampler(
                temp=sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k
            )
            self._samplers[key] = sampler
        return sampler
