"""Engine errors: one base class, one subclass per way a request can be refused or fail."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for every error the engine raises."""

    code = "engine_error"


class UnknownModelError(EngineError):
    """The requested model instance is not registered with the engine."""

    code = "model_not_found"


class ModelLoadError(EngineError):
    """The model's weights could not be loaded (bad folder, missing files, offline hub)."""

    code = "model_load_failed"


class DraftMismatchError(ModelLoadError):
    """The model's draft model does not share its vocabulary (speculative decoding)."""

    code = "draft_mismatch"


class WeightsChangedError(ModelLoadError):
    """The folder's files no longer match the fingerprint they were registered with (REG-3)."""

    code = "weights_changed"


class HubError(ModelLoadError):
    """The Hugging Face hub could not give a revision's files: unreachable, refused (401, gated),
    no such repo or revision (404), or no room on disk for them. `reason` says which."""

    code = "hub_error"

    def __init__(self, message: str, reason: str = "unknown") -> None:
        super().__init__(message)
        self.reason = reason


class InvalidModelFolderError(EngineError):
    """A model folder is unsafe or incomplete (remote code, non-safetensors weights, no config)."""

    code = "invalid_model_folder"


class PromptTooLongError(EngineError):
    """The rendered prompt has more tokens than the model's `max_input_tokens` allows."""

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, limit: int, *, at_least: bool = False) -> None:
        # `at_least`: refused by its characters before tokenizing, so `prompt_tokens` is a floor.
        count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        super().__init__(f"The prompt has {count} tokens; this model accepts at most {limit}.")
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.at_least = at_least


class InvalidRequestError(EngineError):
    """A request setting the loaded model cannot use (a token id outside its vocabulary, ...)."""

    code = "invalid_value"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ImagesNotSupportedError(EngineError):
    """A request with images named an alias whose model reads no images (not kind `vision`)."""

    code = "images_not_supported"

    def __init__(self, name: str, kind: str, param: str = "messages") -> None:
        super().__init__(
            f"{name!r} is a {kind} model (kind {kind!r}): it reads no images. "
            "Send images to an alias of a vision model (kind 'vision'), or send text only."
        )
        self.param = param


class InvalidImageError(EngineError):
    """An image the server refuses: not a supported format, unreadable, or over a limit; `param`
    names the part (docs/api.md#images)."""

    code = "invalid_image"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class WrongModelKindError(EngineError):
    """An embedding model named on a chat surface, or a chat model on /v1/embeddings (API-13)."""

    code = "wrong_model_kind"
    param = "model"

    @classmethod
    def embedding_on_chat(cls, name: str) -> WrongModelKindError:
        return cls(
            f"{name!r} is an embedding model: it turns text into vectors and cannot chat. "
            "Send it to POST /v1/embeddings."
        )

    @classmethod
    def chat_on_embeddings(cls, name: str) -> WrongModelKindError:
        return cls(
            f"{name!r} is a chat model, not an embedding model; POST /v1/embeddings serves embedding models only."
        )


class EmbeddingFailedError(EngineError):
    """The worker raised while embedding; the message is safe to show a client."""

    code = "embedding_failed"


class RequestTooLargeError(EngineError):
    """The request's KV cache (prompt plus requested output) cannot fit the memory budget."""

    code = "request_too_large"

    def __init__(self, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"This request needs about {needed_bytes / 2**20:.0f} MiB of KV cache for its prompt and "
            f"max_tokens; this server can give one request at most {budget_bytes / 2**20:.0f} MiB. "
            "Send a shorter prompt or a lower max_tokens."
        )
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


class GrammarFailedError(EngineError):
    """A request's grammar refused the text while generating: that request's failure, logged as
    one line with its id (never a traceback), and never counted as a fault of the model."""

    code = "generation_failed"


class GenerationFailedError(EngineError):
    """The worker thread raised while generating; the message is safe to show a client."""

    code = "generation_failed"


class EngineClosedError(EngineError):
    """The engine is shutting down and accepts no new work."""

    code = "engine_closed"


class QueueFullError(EngineError):
    """The lane is over budget (active + queued + permits >= capacity + queue depth)."""

    code = "queue_full"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DrainingError(EngineError):
    """The lane is draining for unload or shutdown and refuses new work."""

    code = "draining"

    def __init__(
        self, message: str = "The model is draining for unload; retry shortly.", *, retry_after: int = 5
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeoutError(EngineError):
    """The request waited in the lane's queue longer than the queue timeout."""

    code = "queue_timeout"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DuplicateRequestError(EngineError):
    """A request with this id is already queued, running or being torn down."""

    code = "duplicate_request"


class RequestCancelledError(EngineError):
    """The request was cancelled (by id, or before it reached the engine)."""

    code = "request_cancelled"


# Admission refusals a client should retry later (LANE-2): OpenAI's 429/503 that Anthropic reports
# as 529 `overloaded_error`, and the WebSocket's error type `overloaded`.
OVERLOADED_CODES = frozenset({QueueFullError.code, DrainingError.code})
# Why a request was refused at admission, as `/metrics` counts it: 429/529 queue_full, 503 draining
# and queue_timeout.
REJECTION_CODES = (QueueFullError.code, DrainingError.code, QueueTimeoutError.code)


class QuantizationError(EngineError):
    """A quantized copy could not be made (an unsupported or already quantized model, a full disk)."""

    code = "quantization_failed"


class InvalidAdapterError(EngineError):
    """A LoRA adapter folder is incomplete, of a kind mlxhost does not serve, or does not fit its
    base model (layer names, shapes, rank); the message lists what does not fit."""

    code = "invalid_adapter"
