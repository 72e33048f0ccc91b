"""The embeddings use case (API-14): resolve an embedding alias, then have the engine embed; the
caller's key is held to its limits and the request tallied in its usage (KEY-2, KEY-4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxhost.engine import EmbeddingRequest, WrongModelKindError
from models_app.accounting import usage
from models_app.catalogue import lookups
from models_app.models import Model
from models_app.turns.binding import engine_for
from models_app.turns.turns import key_admit, overload_counted

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mlxhost.engine import Embeddings
    from models_app.accounting.identity import KeyIdentity


async def embeddings_create(
    *,
    model: str,
    texts: Sequence[str | tuple[int, ...]],
    request_id: str,
    owner_id: int,
    key: KeyIdentity | None = None,
    dimensions: int | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> Embeddings:
    """Embed `texts` with the embedding model the alias `model` names, on its lane (API-14).

    The alias's `max_input_tokens` limits each input; its model's Matryoshka flag says whether
    fewer `dimensions` may be asked for. Token arrays among `texts` are turned into text by
    `decode`, in the engine, once each is known to fit. Like a turn, the request counts against
    `key`'s requests per minute and the day's tokens (KEY-4); once embedded it is one request and
    its input tokens in the key's usage, and a refusal by the limits or a busy model is tallied
    as one (KEY-2).

    Raises:
        RateLimitedError: the key is over one of its limits.
        ModelAlias.DoesNotExist: no enabled alias has that name.
        WrongModelKindError: the alias names a chat model (API-13), before any lane permit.
        EngineError: refused by the lane or the engine (429/503/400 via the error table).
    """
    await key_admit(key, owner_id=owner_id)
    alias = await lookups.alias_resolve(model)
    if alias.model.kind != Model.Kind.EMBEDDING:
        raise WrongModelKindError.chat_on_embeddings(alias.name)
    engine = await engine_for(alias.name)
    request = EmbeddingRequest(
        request_id=request_id,
        binding=alias.name,
        texts=tuple(texts),
        dimensions=dimensions,
        truncatable=alias.model.matryoshka,
        max_input_tokens=alias.max_input_tokens,
        decode=decode,
    )
    with overload_counted(key, owner_id=owner_id):
        result = await engine.embed(request)
    usage.recorder().embedded(result.prompt_tokens, owner_id=owner_id, key_id=key.key_id if key else None)
    return result
