"""Plain value types shared by the engine and its callers: requests, sampling, specs, events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant"]
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str


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


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the engine needs to host one registration of weights (REG-3); never an alias."""

    instance_id: int
    source: str  # an absolute local folder, or a Hugging Face repo id
    fingerprint: str
    revision: str | None = None
    max_input_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    model: ModelSpec
    sampling: SamplingParams
    messages: tuple[Message, ...] = ()
    prompt: str | None = None  # raw text completion instead of a chat template


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ms: float
    ttft_ms: float
    prefill_tps: float
    decode_tps: float


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    token_ids: tuple[int, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: FinishReason
    usage: Usage
    timings: Timings


@dataclass(frozen=True, slots=True)
class Failed:
    code: str
    message: str


Event = Started | Delta | Done | Failed
