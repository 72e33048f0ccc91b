"""Bounded work on every surface with the real tiny model and MiniLM (issue 25): a prompt too long
in characters is refused before any tokenizer runs; long words and token arrays on embeddings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from api.openai import embeddings as embeddings_view
from mlxhost.engine.backends.mlx.backend import MlxModel
from mlxhost.engine.backends.mlx.embedding import MlxEmbedder
from tests.api.support import post_any

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

# About 4 MB of ordinary words: under the 4 MiB body limit, over 13 characters a token (the tiny
# model's longest vocabulary entry) x its 131,072-token context.
HUGE = "word " * 800_000


@pytest.fixture
def tokenizer_calls(monkeypatch) -> list[str]:
    """Every template render and tokenization the real backends run, by name."""
    calls: list[str] = []
    for cls, name in (
        (MlxModel, "render_chat"),
        (MlxModel, "encode"),
        (MlxEmbedder, "tokenize"),
    ):
        original = getattr(cls, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    return calls


SURFACES = [
    pytest.param(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "openai", id="chat"
    ),
    pytest.param("/v1/completions", {"prompt": HUGE}, "openai", id="completions"),
    pytest.param("/v1/responses", {"input": HUGE, "store": False}, "openai", id="responses"),
    pytest.param(
        "/v1/messages",
        {"max_tokens": 4, "messages": [{"role": "user", "content": HUGE}]},
        "anthropic",
        id="messages",
    ),
    pytest.param(
        "/v1/messages/count_tokens",
        {"messages": [{"role": "user", "content": HUGE}]},
        "anthropic",
        id="count_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "dialect"), SURFACES)
async def test_a_4_mib_prompt_is_refused_without_tokenizing(
    tiny_alias, api_key, mlx_engine, tokenizer_calls, path, body, dialect
):
    """Every surface answers a prompt longer in characters than the context could hold with 400
    context_length_exceeded in its envelope, and no template or tokenizer ran for it."""
    response = await post_any(api_key, path, {"model": "tiny", **body})
    assert response.status_code == 400, response.content
    fewest = -(-len(HUGE) // 13)  # the fewest tokens 4 MB can be at 13 characters a token
    if dialect == "openai":
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert f"resulted in at least {fewest} tokens" in error["message"]
    else:
        body_ = response.json()
        assert body_["type"] == "error" and body_["error"]["type"] == "invalid_request_error"
        assert body_["error"]["message"] == f"prompt is too long: {fewest} tokens > 131071 maximum"
    assert tokenizer_calls == []


async def test_an_ordinary_prompt_still_tokenizes(tiny_alias, api_key, mlx_engine, tokenizer_calls):
    """The spy sees real work: a short count_tokens renders once."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
    response = await post_any(api_key, "/v1/messages/count_tokens", body)
    assert response.status_code == 200 and response.json()["input_tokens"] > 0
    assert tokenizer_calls == ["render_chat"]


# Embeddings (MiniLM: WordPiece reads at most 100 characters a word, 256 tokens an input) -------


@pytest.fixture
def wordpiece(minilm_folder) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(minilm_folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


async def embedded_tokens(api_key: str, value) -> int:
    response = await post_any(api_key, "/v1/embeddings", {"model": "minilm", "input": value})
    assert response.status_code == 200, response.content
    return response.json()["usage"]["prompt_tokens"]


async def test_a_word_over_100_characters_is_read_in_pieces_not_as_one_unknown(
    minilm_alias, api_key, mlx_engine, wordpiece
):
    """A 250-character run without a space was one [UNK] (3 tokens with [CLS] and [SEP]); now it
    is read as pieces of 100, 100 and 50 characters, exactly as WordPiece reads those pieces."""
    assert len(wordpiece.encode("a" * 250).ids) == 3  # what the tokenizer alone makes of it
    expected = len(wordpiece.encode(f"{'a' * 100} {'a' * 100} {'a' * 50}").ids)
    assert expected > 100
    assert await embedded_tokens(api_key, "a" * 250) == expected
    mixed = f"before {'b' * 150} after"
    assert await embedded_tokens(api_key, mixed) == len(
        wordpiece.encode(f"before {'b' * 100} {'b' * 50} after").ids
    )


async def test_long_runs_made_of_short_words_are_read_as_before(minilm_alias, api_key, mlx_engine, wordpiece):
    """A URL of 200 characters is many short words to WordPiece (it splits at punctuation): its
    count is the tokenizer's own, nothing cut."""
    url = "https://example.com/" + "/".join(["section"] * 23)
    assert len(url) > 180
    assert await embedded_tokens(api_key, url) == len(wordpiece.encode(url).ids)


async def test_an_embedding_input_too_long_in_characters_is_refused_without_tokenizing(
    minilm_alias, api_key, mlx_engine, tokenizer_calls
):
    """4 MB of words for a 256-token model: a 400 naming the input, before its tokenizer runs."""
    response = await post_any(api_key, "/v1/embeddings", {"model": "minilm", "input": ["fine", HUGE]})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "input[1]" and "256 per input" in error["message"]
    assert tokenizer_calls == []


async def test_token_arrays_over_the_models_limit_are_refused_before_decoding(
    minilm_alias, api_key, mlx_engine, monkeypatch
):
    """A cl100k_base array of 257 ids for a 256-token model is a 400 naming it; it is never
    decoded. One of 7 ids is decoded once and embedded."""
    decoded: list[int] = []
    original = embeddings_view.decode_tokens

    def spy(ids):
        decoded.append(len(ids))
        return original(ids)

    monkeypatch.setattr(embeddings_view, "decode_tokens", spy)
    response = await post_any(api_key, "/v1/embeddings", {"model": "minilm", "input": [[15339] * 257]})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "input[0]" and "token array has 257 tokens" in error["message"]
    assert decoded == []
    assert await embedded_tokens(api_key, [791, 8415, 23874, 389, 279, 5634, 13]) > 0
    assert decoded == [7]
