"""Issue 25: generated text continues the prompt's text exactly, and logprob tokens join to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlxhost.engine import Message, ModelSpec, SamplingParams
from mlxhost.engine.backends.base import StepEnd
from mlxhost.engine.backends.mlx.detokenizer import ExactDetokenizer, spelled
from mlxhost.engine.types import TokenLogprob

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(120)

# Prompts whose greedy continuation on the tiny model starts with a space (" could", " children").
PROMPTS = ("1, 2, 3,", "The baker", "Once upon a time")
TEXTS = ("1, 2, 3, 4, 5", "Grüße aus Köln, 日本語 and ☃ snow", "the baker  opened\n\nhis shop")


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    loaded = MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *_: None)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def spm_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace "▁" words, as Llama 2 and Mistral have): its
    decoder drops the space of a text's first word, which a continuation must keep."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_], show_progress=False)
    tokenizer.train_from_iterator(["the baker opened his shop", *TEXTS] * 20, trainer)
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tokenizer))  # as mlx-lm loads one


def segments(tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detokenizer = ExactDetokenizer(tokenizer, prompt_ids)
    out = [detokenizer.add_token(token) for token in ids]
    out[-1] += detokenizer.finalize()
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_every_cut_of_a_text_continues_it_exactly(model, spm_tokenizer, text):
    """Cut between any two characters, the generated side's segments are exactly the rest of
    the text: no leading space lost (BPE and SPM), no character split or doubled."""
    for tokenizer in (model._tokenizer, spm_tokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False)
        whole = tokenizer.decode(ids)
        for cut in range(1, len(ids)):
            prompt = tokenizer.decode(ids[:cut])
            if prompt.endswith("\ufffd"):
                continue  # inside a character: no prompt text ends there
            got = segments(tokenizer, ids[:cut], ids[cut:])
            assert prompt + "".join(got) == whole, (cut, got)
            assert all("\ufffd" not in piece for piece in got)  # a character goes out whole


def test_a_character_goes_out_with_the_token_that_completes_it(model):
    """ "é" is two byte tokens for the tiny tokenizer: the first adds nothing, the second the letter."""
    ids = model.encode("é")
    assert len(ids) == 2
    assert segments(model._tokenizer, model.encode("caf"), ids) == ["", "é"]


def test_a_cut_character_is_flushed_as_a_replacement(model):
    """At the end, bytes that never became a character read U+FFFD (the stop matcher drops it)."""
    assert segments(model._tokenizer, model.encode("caf"), model.encode("é")[:1]) == ["\ufffd"]


def test_spelled_takes_the_segment_and_keeps_the_bytes():
    lead = TokenLogprob("\ufffd", (0xC3,), -0.5)
    assert spelled(lead, "") == TokenLogprob("", (0xC3,), -0.5)
    assert spelled(None, "x") is None


def generated(steps) -> tuple[str, list[int], list[str]]:
    text, ids, tokens = "", [], []
    for step in steps:
        text += step.text
        if not isinstance(step, StepEnd):
            ids.append(step.token_id)
            tokens.append(step.logprob.token)
    return text, ids, tokens


@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached-prefix"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_continuation_keeps_its_first_space_alone(model, tiny_eos_id, prompt, cached):
    """The exclusive path: `prompt + text` is the decoding of prompt + output ids, and the
    logprob tokens join to the text (`{"prompt":"1, 2, 3,"}` answered "could", losing " ")."""
    ids = model.encode(prompt)
    reuse = len(ids) - 1 if cached else 0  # all but the last token from the cache: all context
    sampling = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, logit_bias=((tiny_eos_id, -100.0),))
    kv = model.new_cache()
    if reuse:
        list(model.generate(ids[:reuse], SamplingParams(temperature=0.0, max_tokens=1), kv))
        model.trim_cache(kv, model.cache_length(kv) - reuse)
    text, out, tokens = generated(model.generate(ids[reuse:], sampling, kv, context=ids[:reuse]))
    assert len(out) == 6
    assert text.startswith(" ") == (prompt != "Once upon a time")  # "timeeee": no space to keep
    assert prompt + text == model._tokenizer.decode(ids + out)
    assert "".join(tokens) == text


@pytest.mark.parametrize("arrival", ["first", "mid-decode"])
def test_a_batched_continuation_keeps_its_first_space(model, tiny_eos_id, arrival):
    """Both ways into a batch (the generator's prefill, and fed alone while others decode)."""
    no_eos = ((tiny_eos_id, -100.0),)
    sampling = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, logit_bias=no_eos)
    batch = model.open_batch(4)
    handles: dict[int, list[int]] = {}
    if arrival == "mid-decode":
        other = SamplingParams(temperature=0.0, max_tokens=40, logit_bias=no_eos)
        running = batch.insert(model.encode("snow on the roofs"), other, None, 0)
        while not any(s.handle == running and s.token_id is not None for s in batch.step()):
            continue
    for prompt in PROMPTS:
        ids = model.encode(prompt)
        handles[batch.insert(ids, sampling, None, 0)] = ids
    steps: dict[int, list] = {h: [] for h in handles}
    while any(not s or s[-1].finish_reason is None for s in steps.values()):
        for step in batch.step():
            if step.handle in steps:
                steps[step.handle].append(step)
    batch.close()
    texts = []
    for handle, ids in handles.items():
        text = "".join(s.text for s in steps[handle])
        out = [s.token_id for s in steps[handle] if s.token_id is not None]
        tokens = [s.logprob.token for s in steps[handle] if s.logprob is not None]
        assert model._tokenizer.decode(ids) + text == model._tokenizer.decode(ids + out)
        assert "".join(tokens) == text
        texts.append(text)
    assert texts[0].startswith(" ")  # the case the issue found: a space mlx-lm's detokenizer drops


@pytest.fixture(scope="module")
def demo(smollm2_folder: Path):
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    loaded = MlxBackend().load(ModelSpec(2, str(smollm2_folder), "d" * 64), lambda *_: None)
    yield loaded
    loaded.close()


def test_the_demo_model_continues_a_prefill_exactly(demo):
    """SmolLM2 (real weights, its own tokenizer): Anthropic's example, the prefill "The capital of
    France is" continued with its space, on the exclusive path and in a batch."""
    messages = [
        Message("user", "What is the capital of France?"),
        Message("assistant", "The capital of France is"),
    ]
    ids = demo.render_chat(messages, continue_final=True)
    decode = demo._tokenizer._tokenizer.decode
    sampling = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    text, out, tokens = generated(demo.generate(ids, sampling, demo.new_cache()))
    assert text == decode(ids + out)[len(decode(ids)) :]
    assert text.startswith(" ") and "".join(tokens) == text
    batch = demo.open_batch(2)
    handle = batch.insert(ids, sampling, None, 0)
    steps: list = []
    while not steps or steps[-1].finish_reason is None:
        steps += [s for s in batch.step() if s.handle == handle]
    batch.close()
    assert "".join(s.text for s in steps) == text
    for cut_text in TEXTS:
        cut_ids = demo.encode(cut_text)
        for cut in range(1, len(cut_ids)):
            prompt = decode(cut_ids[:cut])
            if not prompt.endswith("\ufffd"):
                assert prompt + "".join(segments(demo._tokenizer, cut_ids[:cut], cut_ids[cut:])) == cut_text
