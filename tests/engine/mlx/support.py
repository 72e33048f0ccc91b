"""Helpers shared by the real-MLX engine tests: requests, submitting a batch at once, outcomes."""

from __future__ import annotations

import asyncio
import threading

from mlxhost.engine import (
    Delta,
    Done,
    Engine,
    Generation,
    GenerationRequest,
    Message,
    ModelSpec,
    SamplingParams,
)
from mlxhost.engine.worker import CallJob
from tests.engine.conftest import collect


async def submit_together(engine: Engine, requests: list[GenerationRequest]) -> list[Generation]:
    """Submit every request while the worker is held, so they all join the batch in one step."""
    hold = threading.Event()
    engine.get(1)._worker.submit(CallJob(lambda: hold.wait(30), lambda _r, _e: None))
    try:
        return [await engine.submit(r) for r in requests]
    finally:
        hold.set()


async def run_together(engine: Engine, requests: list[GenerationRequest]) -> list[list]:
    generations = await submit_together(engine, requests)
    return await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 60)


def outcome(events: list) -> tuple:
    """What must match between schedulers: text, token ids, finish reason and usage."""
    done = events[-1]
    assert isinstance(done, Done), done
    text = "".join(e.text for e in events if isinstance(e, Delta))
    ids = tuple(t for e in events if isinstance(e, Delta) for t in e.token_ids)
    return text, ids, done.finish_reason, done.usage.completion_tokens


def chat(spec: ModelSpec, request_id: str, messages, session=None, **sampling) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        binding=f"instance:{spec.instance_id}",  # what `engine.load(spec)` bound
        sampling=SamplingParams(**{"temperature": 0.0, **sampling}),
        messages=tuple(Message(role, content) for role, content in messages),
        session=session,
    )


def greedy_alone(base: str, adapter_path: str | None, prompt: str, max_tokens: int) -> list[list[int]]:
    """mlx-lm alone (`load(base, adapter_path=...)`, `stream_generate`, greedy) on a one-message chat:
    the answer's tokens as their bytes (what logprobs report), without the EOS."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from mlxhost.engine.backends.mlx.grammar import Vocabulary

    model, tokenizer = mlx_lm.load(base, adapter_path=adapter_path)[:2]
    vocabulary = Vocabulary(tokenizer, model.args.vocab_size)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    responses = mlx_lm.stream_generate(
        model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(0.0)
    )
    tokens = [int(r.token) for r in responses]
    return [list(vocabulary.token_bytes(t)) for t in tokens if t not in tokenizer.eos_token_ids]
