"""Plain value types shared by the engine and its callers: requests, sampling, specs, events."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from array import array
    from collections.abc import Callable, Sequence

    from mlxhost.engine.sessions import SessionQuery

Role = Literal["system", "user", "assistant", "tool"]
# "cancelled": a client or a cancel by id stopped it; "aborted": the server cut it short
# (a drain for unload, reload or shutdown ran past its timeout). Neither is a complete answer.
# "tool_calls": the answer ended with one or more complete tool calls.
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "aborted", "error"]
ToolMode = Literal["auto", "none", "required"]
# What a model does (API-13): answers chats, turns text into vectors, or answers chats that may
# hold images (a vision-language model through mlx-vlm, docs/models.md).
ModelKind = Literal["chat", "embedding", "vision"]
# The kinds that generate: every chat surface serves them.
GENERATING_KINDS: frozenset[str] = frozenset({"chat", "vision"})


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: `arguments` is the text of a JSON object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Image:
    """An image of a message (docs/api.md#images): the file as sent (`encoded`, its bytes already
    within the limits), and once decoded (`images.decode_image`) its RGB `pixels`, row by row,
    with the SHA-256 of those pixels; `param` is the request field that held it, for errors."""

    param: str
    encoded: bytes = b""
    media_type: str = ""  # what the request declared (a data URL's type), "" when it said none
    pixels: bytes = b""
    width: int = 0
    height: int = 0
    digest: str = ""

    @property
    def decoded(self) -> bool:
        return self.width > 0


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a "tool" turn: the call it answers...
    name: str | None = None  # ...and the function's name
    # A user turn's images, in order; the text's place for them is the model's template's.
    images: tuple[Image, ...] = field(default=(), repr=False)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; `parameters` is the text of its JSON schema."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'
    # The request field that holds the schema (`tools[0].function.parameters`), for errors.
    param: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the model may (auto), must not (none) or must (required) call a tool; a `name`
    forces that one function; `single` keeps at most one call (parallel calls off)."""

    mode: ToolMode = "auto"
    name: str | None = None
    single: bool = False


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint on the generated text: a JSON schema's text (`json`) or a Lark grammar
    (`lark`), in llguidance's dialects. Compiled once per model and cached."""

    kind: Literal["json", "lark"]
    source: str


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    bytes: tuple[int, ...]
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log probability and the `top` alternatives (most likely first)."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings after merging request > alias default > engine default."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Decoding constraints ride with the sampling settings, as in vLLM: a grammar the output
    # must match, and how many alternatives to report per token (None: no logprobs).
    grammar: Grammar | None = None
    logprobs: int | None = None


# The sampling knobs a request sets by name, in the engine's names (`grammar` comes from a
# response format, never a knob of its own): what every surface's overrides carry.
SAMPLING_KNOBS = tuple(f.name for f in fields(SamplingParams) if f.name != "grammar")
# The knobs an alias holds a default for (its columns of the same names); the others are set
# per request only.
ALIAS_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


@dataclass(frozen=True, slots=True)
class LaneSettings:
    """Admission settings of an instance's lane (LANE-1/2/8), edited on the model (never an alias)."""

    capacity: int = 1
    queue_depth: int = 16
    unbounded: bool = False
    queue_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class KVQuantization:
    """A model's KV cache format (issue 28): `bits` (4 or 8) per number in groups of `group_size`
    along the head dimension. `start`: a sequence run alone keeps full precision until it holds
    this many tokens (mlx-lm's `quantized_kv_start`); a batch quantizes every row from its first
    token (backends/mlx/quantized_kv.py)."""

    bits: int
    group_size: int = 64
    start: int = 0

    @property
    def tag(self) -> str:
        """The format in a cache key: KV of one format is never reused under another."""
        return f"kv{self.bits}g{self.group_size}s{self.start}"

    @classmethod
    def from_tag(cls, tag: str) -> KVQuantization | None:
        """The format a `tag` names; None for "" (full precision)."""
        if not tag:
            return None
        bits, rest = tag.removeprefix("kv").split("g", 1)
        group, start = rest.split("s", 1)
        return cls(int(bits), int(group), int(start))

    def bytes_per_element(self, itemsize: int) -> float:
        """Bytes one cached number takes: its bits, plus a scale and a bias per group."""
        return self.bits / 8 + 2 * itemsize / self.group_size


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the engine needs to host one registration of weights (REG-3); never an alias.

    `instance_id` is the caller's id for these weights (a database sequence); the registry
    may keep an older id for the same weights (a live binding or a tombstone, REG-7).
    `keep_alive_s` and `pinned` are the model's memory policy (OPS-3): free the weights after
    that many idle seconds (None: never); pinned weights are never freed for idleness or for
    the memory budget. Only control (reconcile, admin actions) hands specs to the engine.
    """

    instance_id: int
    source: str  # an absolute local folder, or a Hugging Face repo id
    fingerprint: str
    revision: str | None = None
    lane: LaneSettings = field(default_factory=LaneSettings)
    keep_alive_s: float | None = None
    pinned: bool = False
    # Re-hash a local folder at every load and refuse it when it no longer matches `fingerprint`
    # (REG-3); the service layer sets it for registered aliases, hand-built specs may skip it.
    verify_weights: bool = False
    # Chat models generate; embedding models turn inputs into vectors (API-13), on the same lane.
    kind: ModelKind = "chat"
    # The KV cache format (issue 28); None keeps the activations' dtype.
    kv_quantization: KVQuantization | None = None
    # A smaller model with the same vocabulary whose drafts this one verifies (speculative
    # decoding, docs/speculation.md); loaded and freed with it. `fingerprint` is then
    # `weights.with_draft(folder fingerprint, draft.fingerprint)`: another draft, other weights.
    draft: ModelSpec | None = None

    @property
    def weights_key(self) -> tuple[str, ...]:
        """What makes two specs the same served weights (REG-2): source, revision and file
        fingerprint, and the KV format where it is quantized (its KV is another cache's)."""
        key = (self.source, self.revision or "", self.fingerprint)
        return key if self.kv_quantization is None else (*key, self.kv_quantization.tag)


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A LoRA adapter applied on the base weights that serve a turn (issue 28): `key` is its files'
    fingerprint (what the loaded model keeps it by, and what scopes its cached KV), `path` its
    absolute folder in mlx_lm.lora's layout, `name` the label shown in metrics and usage."""

    key: str
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class RowGroup:
    """One of a request's `size` choices (OpenAI `n`): the rows of one `key` share one prompt,
    and in a batch the first row (`index` 0) prefills it once for the others (docs/api.md)."""

    key: str
    index: int
    size: int


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One turn. `binding` names what serves it (an alias) and is only resolved, never bound:
    binding, swapping and reloading belong to control (REG-5), so a request that read an older
    row can never move a name back to old weights."""

    request_id: str
    binding: str
    sampling: SamplingParams
    messages: tuple[Message, ...] = ()
    prompt: str | None = None  # raw text completion instead of a chat template
    session: SessionQuery | None = None  # warm-session lookup and adoption; None = neither
    # The alias's input limit, below the model's context (None: the context only).
    max_input_tokens: int | None = None
    # A stored response: its KV cache is also saved to the disk tier (when there is one), so a
    # continuation after a restart loads it instead of replaying the chain.
    keep_on_disk: bool = False
    # Functions the model may call, and whether it must; `json_format` asks for a JSON answer
    # (a schema's text, or "" for any JSON object). See structure.py.
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    json_format: str | None = None
    # How the surface's provider starts a tool call's id: OpenAI "call_", Anthropic "toolu_".
    call_id_prefix: str = "call_"
    # The request field that holds `json_format` (`text.format` on Responses), for errors.
    format_param: str = "response_format"
    # Chat-template switches (an alias's `enable_thinking`), passed to the template as keywords.
    template_options: tuple[tuple[str, object], ...] = ()
    # Render without a generation prompt and continue the last (assistant) message.
    continue_final: bool = False
    # Speculative decoding (docs/speculation.md): the most tokens one decode step may draft for
    # this turn (the alias's cap; 0: never drafts), and the client's predicted output (OpenAI
    # Predicted Outputs), the draft source while the answer follows it.
    max_draft: int = 8
    prediction: str | None = None
    # One choice of a request with several (`n` > 1); None: the request's only one.
    rows: RowGroup | None = None
    # The alias's LoRA adapter on the base weights (None: the base alone); its KV is its own.
    adapter: AdapterRef | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """Texts to embed (API-14). Like a turn, `binding` names the alias and is only resolved.

    `dimensions` asks for fewer dimensions than the model's (None: all of them); a model that
    allows it (`truncatable`, Matryoshka) truncates and renormalises. `max_input_tokens` is the
    alias's per-input limit, below the model's own. An input may be token ids of another
    tokenizer (OpenAI's token arrays): `decode` turns them into text (raising ValueError, with a
    message for the client, on ids it cannot read), once the array is known to be no longer
    than the model's limit, so a huge array is never decoded.
    """

    request_id: str
    binding: str
    texts: tuple[str | tuple[int, ...], ...]
    dimensions: int | None = None
    truncatable: bool = False
    max_input_tokens: int | None = None
    decode: Callable[[Sequence[int]], str] | None = None


@dataclass(frozen=True, slots=True)
class Embeddings:
    """The vectors of an `EmbeddingRequest`, in input order: float32 arrays of `dimensions`
    numbers each, normalised as the model's pooling says; `prompt_tokens` counts every input's
    tokens as the model read them (special tokens included)."""

    vectors: tuple[array[float], ...]
    prompt_tokens: int
    dimensions: int
    queue_ms: float = 0.0
    compute_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # With a prediction (OpenAI Predicted Outputs): its tokens the output reproduced in order,
    # and the rest of its tokens (docs/speculation.md); 0 without one.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ms: float
    ttft_ms: float
    prefill_tps: float
    decode_tps: float
    # Speculative decoding (docs/speculation.md): tokens this turn drafted, those the model
    # accepted, and the tokens each decode pass it took part in gave it (0 where it could not
    # draft: speculation off, a grammar, a batch that does not speculate).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    tokens_per_pass: float = 0.0

    def as_body(self) -> dict[str, float | int]:
        """The figures as a client sees them (the socket's terminal frame, a stored turn):
        times rounded to 0.1, and the speculation counts where the turn drafted."""
        body: dict[str, float | int] = {
            "queue_ms": round(self.queue_ms, 1),
            "ttft_ms": round(self.ttft_ms, 1),
            "prefill_tps": round(self.prefill_tps, 1),
            "decode_tps": round(self.decode_tps, 1),
        }
        if self.tokens_per_pass:
            body["drafted_tokens"] = self.drafted_tokens
            body["accepted_tokens"] = self.accepted_tokens
            body["tokens_per_pass"] = round(self.tokens_per_pass, 2)
        return body


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits in its lane; `position` is 1 for the next one in."""

    position: int


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Delta:
    """Answer text (with tool calls or reasoning, only the answer's part of it)."""

    text: str
    token_ids: tuple[int, ...] = field(default=())
    logprobs: tuple[TokenLogprob, ...] = ()  # with SamplingParams.logprobs: one per token id


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Text between the model's thinking markers, never part of the answer."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """Part of tool call number `index`: its first part names it (`id`, `name`), the next ones
    carry pieces of its arguments' JSON text, in order."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stop_sequence: str | None = None  # with finish_reason "stop": the stop string that ended it
    tool_calls: tuple[ToolCall, ...] = ()  # every complete call of the answer
    reasoning: str = ""  # the whole reasoning text, when the model reasoned


@dataclass(frozen=True, slots=True)
class Failed:
    code: str
    message: str
    retry_after: int | None = None


Event = Queued | Started | Delta | ReasoningDelta | ToolCallDelta | Done | Failed
