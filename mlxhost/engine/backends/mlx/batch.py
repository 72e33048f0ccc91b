"""Continuous batching on mlx-lm's `BatchGenerator`: the mlx `BatchRunner`."""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from mlxhost.engine.backends.base import BatchStep, DraftCounts, SequenceCache
from mlxhost.engine.backends.mlx.adapters import RowAdapters
from mlxhost.engine.backends.mlx.detokenizer import ExactDetokenizer, spelled
from mlxhost.engine.backends.mlx.drafting import PredictionAligner, SpeculationConfig
from mlxhost.engine.backends.mlx.grammar import GrammarProcessor
from mlxhost.engine.backends.mlx.quantized_kv import batch_rows
from mlxhost.engine.backends.mlx.speculative import RowPlan, SpeculativeGenerationBatch
from mlxhost.engine.errors import GrammarFailedError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mlxhost.engine.backends.mlx.adapters import AdapterBank
    from mlxhost.engine.backends.mlx.draft_model import DraftModelRows
    from mlxhost.engine.backends.mlx.grammar import Vocabulary
    from mlxhost.engine.types import AdapterRef, KVQuantization, SamplingParams, TokenLogprob

# Sequences prefilled together; more would make a long prompt's arrival stall every stream longer.
PREFILL_BATCH = 8
# Prompt tokens per sequence per step while other sequences decode: a long prompt is prefilled in
# chunks between decode steps instead of freezing every stream for its whole prefill. Measured
# on 2 CPU cores with SmolLM2-135M (benchmarks/README.md): a 1500-token arrival stalled the
# running streams for 25.7 s in one 2048-token chunk, for at most 2.1 s in 128-token chunks.
PREFILL_STEP = 128
# With no stream decoding there is nobody to be fair to. GPUs keep mlx-lm's default chunk; on
# CPU, attention over one long chunk is slower than over several short ones (same prompt:
# 33 s in one chunk, 17 s in 128-token chunks), so the CPU chunks the same way alone.
PREFILL_STEP_ALONE = 2048 if mx.default_device().type == mx.DeviceType.gpu else PREFILL_STEP
_SAMPLER_MEMO = 64

logger = logging.getLogger(__name__)


def make_request_sampler(sampling: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for `sampling`; with a seed, one that draws from its own random key.

    mlx-lm samples from MLX's one global random state, and `mx.random.seed` would reseed it
    for every request of every model in the process. A seeded request splits its own key per
    token instead, so the same seed gives the same text and nobody else's draws change.
    """
    if sampling.seed is None or sampling.temperature == 0:
        return make_sampler(
            temp=sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k
        )
    temperature, top_p, min_p, top_k = sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k
    key = [mx.random.key(sampling.seed)]

    def sample(logprobs: mx.array) -> mx.array:
        # The same filters in the same order as mlx-lm's make_sampler.
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p != 0.0:
            logprobs = apply_min_p(logprobs, min_p, 1)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1.0 / temperature), key=draw)

    return sample


def reseed_global_random() -> None:
    """Give MLX a fresh global random state: a sampler that raised inside a compiled function
    leaves the old one unusable ("eval an array without a primitive") for every later draw."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


class _Guard:
    """Runs one sequence's logits processors, or one shared sampler, inside a batch step.

    An exception there belongs to the requests using it, not to the batch: the guard records
    it and stands in (greedy pick, logits unchanged) so the step completes for everyone, and
    the batch then ends only the faulted sequences. A grammar refusing the text is the
    request's own failure, told by the scheduler in one line with its id; anything else is a
    bug, logged here with its traceback.
    """

    __slots__ = ("faulted", "reason")

    def __init__(self) -> None:
        self.faulted = False
        self.reason = ""  # one line: what failed

    def _record(self, what: str, error: Exception) -> None:
        if not isinstance(error, GrammarFailedError):
            logger.exception("a sequence's %s failed", what)
        self.faulted = True
        self.reason = str(error) or type(error).__name__

    def sampler(self, sample: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        def guarded(logprobs: mx.array) -> mx.array:
            if not self.faulted:
                try:
                    return sample(logprobs)
                except Exception as error:
                    self._record("sampler", error)
            return mx.argmax(logprobs, axis=-1)

        return guarded

    def processor(self, process: Callable[[mx.array, mx.array], mx.array]) -> Callable[..., mx.array]:
        def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
            if not self.faulted:
                try:
                    return process(tokens, logits)
                except Exception as error:
                    self._record("logits processor", error)
            return logits

        return guarded


def _reason(guards: Sequence[_Guard]) -> str:  # the first fault's one line
    return next((g.reason for g in guards if g.faulted), "")


def with_context(processor: Any, context: Sequence[int]) -> Callable[[mx.array, mx.array], mx.array]:
    """`processor` seeing `context` (the prompt's cached start) before the tokens mlx-lm passes it,
    which are only what was fed this time: a penalty then looks back over the whole prompt, as
    it would on a fresh run, and a cached prefix never changes the answer."""
    prefix = mx.array(list(context), dtype=mx.uint32)

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        return cast("mx.array", processor(mx.concatenate([prefix, tokens.astype(mx.uint32)]), logits))

    return process


def make_processors(sampling: SamplingParams, vocabulary: Vocabulary | None = None) -> list[Any]:
    """mlx-lm logits processors for `sampling`: logit bias and the three penalties, then the
    grammar's mask (last, so nothing lifts a token it forbids)."""
    processors = make_logits_processors(
        logit_bias=dict(sampling.logit_bias) or None,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )
    if sampling.grammar is not None:
        if vocabulary is None:
            raise ValueError("a grammar needs the model's vocabulary")
        grammar = sampling.grammar
        forget = partial(vocabulary.forget, grammar)  # a step that fails evicts its grammar
        processors.append(GrammarProcessor(vocabulary.matcher(grammar), vocabulary.logits_size, forget))
    return processors


class MlxBatch:
    """A `BatchGenerator` plus one exact detokenizer per sequence; worker thread only.

    The generator stops a sequence on the model's EOS tokens ("stop", not shown or counted,
    as `stream_generate` does); text stop strings are the worker's. Every returned token has
    already been fed, so a finished sequence's cache holds prompt + generated (+ EOS), and
    `all_tokens` (seeded with the cached prefix) lists exactly those tokens.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        capacity: int,
        *,
        prefill_step: int = PREFILL_STEP,
        prefill_step_alone: int = PREFILL_STEP_ALONE,
        vocabulary: Vocabulary | None = None,
        speculation: SpeculationConfig | None = None,
        kv_quantization: KVQuantization | None = None,
        draft: DraftModelRows | None = None,
        adapters: AdapterBank | None = None,
    ) -> None:
        """`draft`: the model's draft model (draft_model.py), which drafts for every row that
        speculates instead of prompt lookup; only with `speculation`."""
        self.capacity = capacity
        self._kv_quantization = kv_quantization  # quantized KV in the batch (quantized_kv.py)
        self._vocabulary = vocabulary
        self._top: dict[int, int] = {}  # handle -> alternatives per token, for requests with logprobs
        self._tokenizer = tokenizer
        self._prefill_step = prefill_step
        self._prefill_step_alone = max(prefill_step, prefill_step_alone)
        eos = sorted(tokenizer.eos_token_ids)
        self._generator = BatchGenerator(
            model,
            stop_tokens=[[token] for token in eos] or None,
            completion_batch_size=capacity,
            prefill_batch_size=min(capacity, PREFILL_BATCH),
            prefill_step_size=self._prefill_step_alone,  # the largest; step() narrows it per step
        )
        self._model = model
        self._eos = set(eos)
        self._detokenizers: dict[int, ExactDetokenizer] = {}
        self._decoding: set[int] = set()  # handles past their prompt, producing tokens
        self._first: dict[int, BatchStep] = {}  # first tokens sampled at insert, out at the next step
        self._ended_handles = 0  # handles (negative) of sequences that ended on their first token
        self._fed_alone = 0  # prompt tokens fed by `_insert_started` since the last step
        self._samplers: dict[tuple[float, float, float, int], tuple[_Guard, Any]] = {}
        self._guards: dict[int, tuple[_Guard, _Guard]] = {}  # handle -> (its sampler's, its own)
        self._speculative: SpeculativeGenerationBatch | None = None  # verifies drafts (speculation.md)
        self._ended_stats: dict[int, DraftCounts] = {}  # rows that ended in the last step
        self.speculation_totals = DraftCounts()  # every row's counts, summed as rows end
        # A row's output followed along its prediction (usage counts); kept like `_ended_stats`.
        self._followers: dict[int, tuple[PredictionAligner, list[int]]] = {}
        self._ended_reproduced: dict[int, int] = {}
        if speculation is not None:
            self._speculative = SpeculativeGenerationBatch.start(
                model, self._generator.sampler, speculation, draft
            )
            self._generator._generation_batch = self._speculative
        self._rows = RowAdapters.install(self._generator, adapters)  # LoRA adapters per row (adapters.py)

    def accepts(self, sampling: SamplingParams) -> bool:
        # Every request shares the batch: a seeded one gets a sampler (its own key) for its row alone.
        return True

    def insert(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        kv: object | None,
        cached: int,
        *,
        prediction_ids: Sequence[int] | None = None,
        max_draft: int | None = None,
        adapter: AdapterRef | None = None,
    ) -> int:
        """Add a sequence under `adapter` (None: the base); returns its handle. With speculation on,
        `prediction_ids` (OpenAI Predicted Outputs) are its drafts, else its own prompt and output;
        `max_draft` caps its drafts per step (0: it never drafts; None: the batch's cap)."""
        if self._kv_quantization is not None:  # every row enters as a mergeable one (quantized_kv.py)
            kv = batch_rows(cast("list[Any]", kv or make_prompt_cache(self._model)), self._kv_quantization)
        suffix = len(prompt_ids) - cached
        slot = self._rows.slot(adapter)  # InvalidAdapterError: the adapter will not load
        # Fed alone while the batch decodes, within one prefill chunk's budget (`prefill_step`).
        if self._decoding and suffix > 0 and self._fed_alone + suffix <= self._prefill_step:
            self._fed_alone += suffix
            self._rows.select(slot)  # its passes run under its adapter
            handle = self._insert_started(prompt_ids, sampling, kv, cached)
            self._rows.add(handle, slot)
            self._plan(handle, prompt_ids, sampling, prediction_ids, max_draft)
            return handle
        sampler_guard, sampler = self._sampler(sampling)
        guard = _Guard()
        (uid,) = self._generator.insert(
            [list(prompt_ids[cached:])],
            max_tokens=[sampling.max_tokens],
            caches=cast("list[list[Any]]", [kv]),  # a None entry: the generator makes a fresh cache
            all_tokens=[list(prompt_ids[:cached])],
            samplers=[sampler],
            logits_processors=[[guard.processor(p) for p in make_processors(sampling, self._vocabulary)]],
        )
        self._detokenizers[uid] = ExactDetokenizer(self._tokenizer, prompt_ids)
        self._guards[uid] = (sampler_guard, guard)
        self._rows.add(uid, slot)
        if sampling.logprobs is not None:
            self._top[int(uid)] = sampling.logprobs
        self._plan(int(uid), prompt_ids, sampling, prediction_ids, max_draft)
        return int(uid)

    def _plan(
        self,
        handle: int,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        prediction: Sequence[int] | None,
        max_draft: int | None = None,
    ) -> None:
        if self._speculative is None or handle < 0:
            return
        # One aligner per prediction: followed here token by token for the usage counts, and
        # read (not observed again) by the row's drafter.
        aligner = PredictionAligner(prediction) if prediction else None
        if aligner is not None:
            self._followers[handle] = (aligner, [])
        plan = RowPlan(
            prompt_length=len(prompt_ids),
            prediction=aligner,
            # a grammar's matcher must not see rejected drafts
            speculate=sampling.grammar is None and max_draft != 0,
            max_draft=max_draft,
            sequential=sampling.seed is not None and sampling.temperature != 0,  # its own key
        )
        self._speculative.register(handle, plan)

    def speculation_stats(self, handle: int) -> DraftCounts | None:
        """A row's drafted / accepted / passes counts: while it runs, and on the step that ends
        it (until the next step). None without speculation or for a row that never drafts."""
        if handle in self._ended_stats:
            return self._ended_stats[handle]
        if self._speculative is None:
            return None
        drafter = self._speculative.drafters.get(handle)
        return drafter.stats if drafter is not None else None

    def prediction_reproduced(self, handle: int) -> int:
        if handle in self._ended_reproduced:
            return self._ended_reproduced[handle]
        follower = self._followers.get(handle)
        return follower[0].reproduced if follower is not None else 0

    def _follow(self, handle: int, token: int | None) -> None:
        follower = self._followers.get(handle)
        if follower is not None and token is not None:
            aligner, output = follower
            output.append(token)
            aligner.observe(output, 1)

    def _release(self, handle: int) -> None:
        self._rows.drop(handle)
        follower = self._followers.pop(handle, None)
        if follower is not None:
            self._ended_reproduced[handle] = follower[0].reproduced
        if self._speculative is None:
            return
        drafter = self._speculative.release(handle)
        if drafter is not None:
            self._ended_stats[handle] = drafter.stats
            self.speculation_totals.add(drafter.stats)

    def _insert_started(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, kv: object | None, cached: int
    ) -> int:
        """Join a decoding batch with the first token already sampled.

        Through the generator alone, an arrival's first token comes three steps after it is
        inserted: its prompt chunk rides one decode step of the others, its last prompt token
        the next, and its first token the one after (each a full step of the whole batch). A
        short uncached suffix is instead fed here, alone, as `stream_generate` feeds it (all but
        the last token, then the last), so the same tokens come out, and its first token is
        sampled at once; the generator then continues from that token. The next `step()` hands
        the first token out before running the batch. Between two steps at most `prefill_step`
        tokens are fed this way, the budget of one prefill chunk: a long arrival, and arrivals
        past the budget (a burst), keep the generator's chunked, batched prefill, so the running
        streams never wait longer than a chunk.
        """
        sampler_guard, sampler = self._sampler(sampling)
        guard = _Guard()
        processors = [guard.processor(p) for p in make_processors(sampling, self._vocabulary)]
        cache = cast("list[Any]", kv) if kv is not None else make_prompt_cache(self._model)
        with mx.stream(generation_stream):
            suffix = mx.array(list(prompt_ids[cached:]), dtype=mx.uint32)
            if suffix.size > 1:
                self._model(suffix[None, :-1], cache=cache)
            logits = self._model(suffix[None, -1:], cache=cache)[:, -1, :]
            context = mx.array(list(prompt_ids), dtype=mx.uint32)
            for processor in processors:
                logits = processor(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = int(sampler(logprobs).item())
        detokenizer = ExactDetokenizer(self._tokenizer, prompt_ids)
        logprob = self._logprob(sampling.logprobs, logprobs, token)
        if guard.faulted or sampler_guard.faulted or token in self._eos or sampling.max_tokens <= 1:
            # Ends on its first token: it never joins the generator (its cache holds the prompt).
            self._ended_handles -= 1
            handle = self._ended_handles
            ended = SequenceCache(cache, tuple(prompt_ids))
            if guard.faulted or sampler_guard.faulted:
                reseed_global_random()  # as `_end_faulted` does: a raising sampler spoils it
                reason = _reason((guard, sampler_guard))
                self._first[handle] = BatchStep(handle, "", None, "error", ended, failed=True, reason=reason)
            elif token in self._eos:
                self._first[handle] = BatchStep(handle, "", None, "stop", ended)
            else:
                text = detokenizer.add_token(token) + detokenizer.finalize()
                self._first[handle] = BatchStep(
                    handle, text, token, "length", ended, logprob=spelled(logprob, text)
                )
            return handle
        (uid,) = self._generator.insert(
            [[token]],
            max_tokens=[sampling.max_tokens - 1],
            caches=[cache],
            all_tokens=[list(prompt_ids)],
            samplers=[sampler],
            logits_processors=[processors],
        )
        text = detokenizer.add_token(token)
        self._detokenizers[uid] = detokenizer
        self._guards[uid] = (sampler_guard, guard)
        self._first[uid] = BatchStep(uid, text, token, logprob=spelled(logprob, text))
        if sampling.logprobs is not None:
            self._top[int(uid)] = sampling.logprobs
        return int(uid)

    def _logprob(self, top: int | None, logprobs: mx.array, token: int) -> TokenLogprob | None:
        if top is None or self._vocabulary is None:
            return None
        return self._vocabulary.logprob(logprobs, token, top)

    def step(self) -> list[BatchStep]:
        self._fed_alone = 0
        self._ended_stats.clear()
        self._ended_reproduced.clear()
        if self._first:  # first tokens sampled at insert go out at once, before a batch step
            first, self._first = list(self._first.values()), {}
            for step in first:
                self._follow(step.handle, step.token_id)
                if step.finish_reason is None:
                    self._decoding.add(step.handle)
            return first
        # next(), not next_generated(): one decode step plus one prefill chunk, so arrivals and
        # cancels are handled between chunks of a long prompt. The generator reads
        # `prefill_step_size` on every call to cut the next chunk of each pending prompt.
        decoding = self._decoding
        self._generator.prefill_step_size = self._prefill_step if decoding else self._prefill_step_alone
        _, responses = self._generator.next()
        faulted = {uid for uid, guards in self._guards.items() if any(g.faulted for g in guards)}
        steps = []
        for response in responses:
            if response.uid in faulted and response.finish_reason is None:
                continue  # ended below, alone
            faulted.discard(response.uid)
            detokenizer = self._detokenizers[response.uid]
            finish = response.finish_reason
            token: int | None = int(response.token)
            text = ""
            if finish == "stop":  # an EOS token: finish the text, neither show nor count the token
                token = None
            else:
                text = detokenizer.add_token(response.token)
                self._follow(response.uid, token)
            cache = None
            decoding.add(response.uid)
            logprob = None
            if token is not None:
                logprob = self._logprob(self._top.get(response.uid), response.logprobs, token)
            if finish is not None:
                text += detokenizer.finalize()
                del self._detokenizers[response.uid]
                del self._guards[response.uid]
                self._top.pop(response.uid, None)
                decoding.discard(response.uid)
                self._release(response.uid)
                cache = SequenceCache(response.prompt_cache, tuple(response.all_tokens))
            steps.append(BatchStep(response.uid, text, token, finish, cache, logprob=spelled(logprob, text)))
        if faulted:
            steps.extend(self._end_faulted(faulted))
        return steps

    def _end_faulted(self, handles: set[int]) -> list[BatchStep]:
        for key, (guard, _) in list(self._samplers.items()):
            if guard.faulted:
                del self._samplers[key]  # later requests get a fresh sampler
        reseed_global_random()
        steps = []
        for handle in sorted(handles):
            reason = _reason(self._guards.get(handle, ()))
            steps.append(
                BatchStep(handle, "", None, "error", self.remove(handle), failed=True, reason=reason)
            )
        return steps

    def remove(self, handle: int) -> SequenceCache:
        first = self._first.pop(handle, None)
        if handle < 0:  # ended on its first token, never in the generator
            assert first is not None and first.cache is not None
            return first.cache
        caches = self._generator.remove([handle], return_prompt_caches=True)
        self._detokenizers.pop(handle, None)
        self._guards.pop(handle, None)
        self._top.pop(handle, None)
        self._decoding.discard(handle)
        self._release(handle)
        kv, tokens = caches[handle]
        return SequenceCache(kv, tuple(tokens))

    def close(self) -> None:
        self._first.clear()
        self._detokenizers.clear()
        self._guards.clear()
        self._decoding.clear()
        self._followers.clear()
        self._generator.close()

    def _sampler(self, sampling: SamplingParams) -> tuple[_Guard, Any]:
        # Sequences holding the same sampler object are sampled in one batched call; a seeded
        # one draws from its own key, so it never shares.
        if sampling.seed is not None and sampling.temperature != 0:
            guard = _Guard()
            return guard, guard.sampler(make_request_sampler(sampling))
        key = (sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k)
        memo = self._samplers.get(key)
        if memo is None:
            if len(self._samplers) >= _SAMPLER_MEMO:
                self._samplers.clear()
            guard = _Guard()
            memo = (guard, guard.sampler(make_request_sampler(sampling)))
            self._samplers[key] = memo
        return memo
