"""Every field of every request serializer with every wrong JSON type: a 400 naming it (API-4).

Generated, not listed: for each surface a valid body that sets every field the serializer
declares (a field added without a value here fails `test_the_bodies_set_every_declared_field`)
is broken one place at a time. A declared field given a JSON type it does not take (array,
object, integer, number, boolean, null, string) must be a 400 in the surface's envelope naming
exactly that field (OpenAI `param`, Anthropic's message). Every other place of the body, inside
the JSON fields too (content blocks, input items, tools, formats), takes every type without a
5xx, and a refusal names the field it is in. Sent over HTTP to each surface with the real tiny
model, over the WebSocket's `response.create`, and, with hypothesis drawing arbitrary JSON, to
the serializers directly.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework import serializers

from api.anthropic.serializers import CountTokensInput, MessagesInput
from api.errors import ApiError
from api.openai.completions import CompletionInput
from api.openai.embeddings import EmbeddingsInput
from api.openai.responses_input import ResponsesInput
from api.openai.serializers import ChatCompletionInput
from api.openai.views import validated
from mlxhost.asgi import application
from tests.support import register_alias

Path = tuple[str | int, ...]

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
SAMPLING = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
            "seed": 1, "logit_bias": {"1": 1}}  # fmt: skip
PENALTIES = {"presence_penalty": 0.1, "frequency_penalty": 0.1}
CACHE = {"prompt_cache_key": "k", "cache_salt": "s", "user": "u"}


@dataclass(frozen=True)
class Surface:
    path: str
    serializer: type[serializers.Serializer[Any]]
    dialect: str
    bodies: tuple[dict[str, Any], ...]  # valid; between them every declared field is set
    # A refusal may name another field that this one's value is checked against.
    related: dict[str, set[str]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.path.removeprefix("/v1/").replace("/", "-")


CHAT = Surface(
    "/v1/chat/completions",
    ChatCompletionInput,
    "openai",
    (
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "r", "name": "f"},
            ],
            **SAMPLING,
            **PENALTIES,
            **CACHE,
            "max_tokens": 1,
            "stop": ["x"],
            "stream": False,
            "stream_options": {"include_usage": True},
            "n": 1,
            "logprobs": True,
            "top_logprobs": 2,
            "tools": [
                {"type": "function", "function": {"name": "f", "description": "d", "parameters": SCHEMA}}
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "metadata": {"a": "b"},
        },
        {
            "model": "tiny",
            "messages": [{"role": "developer", "content": "s"}, {"role": "user", "content": "hi"}],
            "max_completion_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            "reasoning_effort": "low",
        },
    ),
    related={"logprobs": {"top_logprobs"}},
)
COMPLETIONS = Surface(
    "/v1/completions",
    CompletionInput,
    "openai",
    (
        {
            "model": "tiny",
            "prompt": "hi",
            **SAMPLING,
            **PENALTIES,
            **CACHE,
            "max_tokens": 1,
            "stop": "x",
            "stream": False,
            "stream_options": {"include_usage": True},
            "n": 1,
            "best_of": 1,
            "logprobs": 1,
        },
    ),
)
RESPONSES = Surface(
    "/v1/responses",
    ResponsesInput,
    "openai",
    (
        {
            "model": "tiny",
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "r"},
                {"type": "reasoning", "summary": []},
            ],
            **SAMPLING,
            **CACHE,
            "instructions": "i",
            "previous_response_id": None,
            "store": False,
            "stream": False,
            "max_output_tokens": 1,
            "stop": ["x"],
            "metadata": {"a": "b"},
            "truncation": "disabled",
            "parallel_tool_calls": True,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 2,
            "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}, {"type": "web_search"}],
            "tool_choice": "auto",
            "reasoning": {"effort": "low", "summary": "auto"},
            "retention_s": 3600,
        },
        {
            "model": "tiny",
            "input": "hi",
            "store": False,
            "max_output_tokens": 1,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}, "verbosity": "low"},
        },
    ),
)
MESSAGES_TURNS = [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                      {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
]  # fmt: skip
MESSAGES = Surface(
    "/v1/messages",
    MessagesInput,
    "anthropic",
    (
        {
            "model": "tiny",
            "messages": MESSAGES_TURNS,
            "system": [{"type": "text", "text": "s"}],
            "max_tokens": 2000,
            "stop_sequences": ["x"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "f", "description": "d", "input_schema": SCHEMA}],
            "tool_choice": {"type": "auto"},
            "metadata": {"user_id": "u"},
            "stream": False,
            "service_tier": "auto",
        },
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}},
        },
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "output_format": {"type": "json_schema", "schema": SCHEMA},
        },
    ),
    # A schema the grammar engine refuses names `output_config.format`, the GA name of the beta's
    # `output_format` (api/anthropic/views.py).
    related={"max_tokens": {"thinking"}, "output_format": {"output_config"}},
)
COUNT_TOKENS = Surface(
    "/v1/messages/count_tokens",
    CountTokensInput,
    "anthropic",
    (
        {
            "model": "tiny",
            "messages": MESSAGES_TURNS,
            "system": "s",
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "f", "input_schema": SCHEMA}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "output_config": {"effort": "low"},
        },
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "adaptive"},
            "output_format": {"type": "json_schema", "schema": SCHEMA},
        },
    ),
    related=MESSAGES.related,
)
EMBEDDINGS = Surface(
    "/v1/embeddings",
    EmbeddingsInput,
    "openai",
    (
        {
            "model": "minilm",
            "input": ["a", [1, 2]],
            "encoding_format": "float",
            "dimensions": 384,
            "user": "u",
        },
        {"model": "minilm", "input": "a"},
    ),
)
SURFACES = [CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, EMBEDDINGS]
WRONG: dict[str, Any] = {
    "array": ["x"],
    "object": {"k": "v"},
    "integer": 3,
    "number": 2.5,
    "boolean": True,
    "null": None,
    "string": "x",
}
# The JSON types each kind of declared field takes (OpenAI's and Anthropic's APIs are as strict).
TAKES: list[tuple[type, set[str]]] = [
    (serializers.JSONField, set(WRONG)),
    (serializers.BooleanField, {"boolean"}),
    (serializers.IntegerField, {"integer"}),
    (serializers.FloatField, {"integer", "number"}),
    (serializers.ChoiceField, {"string"}),
    (serializers.CharField, {"string"}),
    (serializers.ListField, {"array"}),
    (serializers.ListSerializer, {"array"}),
    (serializers.DictField, {"object"}),
    (serializers.Serializer, {"object"}),
]


def takes(declared: serializers.Field[Any, Any, Any, Any]) -> set[str]:
    kinds = next(kinds for kind, kinds in TAKES if isinstance(declared, kind))
    return kinds | ({"null"} if declared.allow_null else set())


def declared_fields(declared: Any, value: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """Each declared field (nested serializers', list items' and dict values' too) that `value`
    sets, with its path."""
    found: list[tuple[Path, Any]] = []
    if isinstance(declared, serializers.ListSerializer):
        for index, item in enumerate(value):
            found += [
                ((*path, index), declared.child),
                *declared_fields(declared.child, item, (*path, index)),
            ]
    elif isinstance(declared, serializers.Serializer):
        for name, child in declared.fields.items():
            if isinstance(value, dict) and name in value:
                found += [((*path, name), child), *declared_fields(child, value[name], (*path, name))]
    elif isinstance(declared, serializers.ListField) and value:
        found += [((*path, 0), declared.child)]
    elif isinstance(declared, serializers.DictField) and value:
        found += [((*path, next(iter(value))), declared.child)]
    return [(p, f) for p, f in found if typed(f)]


def typed(declared: Any) -> bool:
    """A field with JSON types of its own (not a JSONField, nor an unvalidated list or dict child)."""
    return any(isinstance(declared, kind) for kind, _ in TAKES[1:])


def places(value: Any, path: Path = ()) -> list[Path]:
    """Every place in a body: each key of each object and each item of each array."""
    found: list[Path] = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += places(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += places(item, (*path, index))
    return found


def with_value(body: dict[str, Any], path: Path, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    holder: Any = body
    for step in path[:-1]:
        holder = holder[step]
    holder[path[-1]] = value
    return body


def param_of(path: Path) -> str:
    """A path as the error's `param` spells it: `messages[0].role`, `logit_bias.1`."""
    text = ""
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else step)
    return text


@dataclass(frozen=True)
class Case:
    body: dict[str, Any]
    path: Path
    kind: str
    exact: bool  # a declared field given a type it does not take: a 400 naming exactly it

    def __str__(self) -> str:
        return f"{param_of(self.path)}={self.kind}"


def cases(surface: Surface) -> list[Case]:
    made: dict[str, Case] = {}
    for base in surface.bodies:
        declared = dict(declared_fields(surface.serializer(), base))
        for path in places(base):
            for kind, value in WRONG.items():
                exact = path in declared and kind not in takes(declared[path])
                case = Case(with_value(base, path, value), path, kind, exact)
                made.setdefault(json.dumps(case.body, sort_keys=True), case)
    return list(made.values())


def named(error: dict[str, Any], surface: Surface, case: Case) -> str | None:
    """Why a 400 does not name the case's field, or None when it does."""
    text = error.get("param") if surface.dialect == "openai" else error["message"].split(":", 1)[0]
    text = text or ""
    want = param_of(case.path)
    if case.exact:
        return None if text == want else f"names {text!r}, not {want!r}"
    head = text.split(".", 1)[0].split("[", 1)[0]
    allowed = {str(case.path[0]), *surface.related.get(str(case.path[0]), set())}
    return None if head in allowed else f"names {text!r}, not within {sorted(allowed)}"


def check(surface: Surface, case: Case, status: int, error: dict[str, Any] | None) -> str | None:
    """What is wrong with an answer to `case`, or None."""
    if status >= 500:
        return f"{status}: {error}"
    if case.exact and status != 400:
        return f"{status}, not 400"
    if status == 400:
        if error is None:
            return "400 without an error body"
        return named(error, surface, case)
    return None


def test_the_bodies_set_every_declared_field():
    """The walk reaches every field: each serializer's fields, nested ones included, are set by
    one of its surface's valid bodies, and those bodies are valid."""
    for surface in SURFACES:
        reached: set[tuple[str, ...]] = set()
        for body in surface.bodies:
            validated(surface.serializer, body)  # raises on an invalid base
            reached |= {
                tuple(str(s) for s in p if isinstance(s, str))
                for p, _ in declared_fields(surface.serializer(), body)
            }

        def every(declared: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
            names: set[tuple[str, ...]] = set()
            if isinstance(declared, serializers.ListSerializer):
                return every(declared.child, prefix)
            if isinstance(declared, serializers.Serializer):
                for name, child in declared.fields.items():
                    if not isinstance(child, serializers.JSONField):
                        names.add((*prefix, name))
                    names |= every(child, (*prefix, name))
            return names

        missing = every(surface.serializer()) - reached
        assert not missing, (surface.path, sorted(missing))


def test_the_walk_is_large():
    """Thousands of generated requests, a few hundred of them wrong types of declared fields."""
    all_cases = [case for surface in SURFACES for case in cases(surface)]
    assert len(all_cases) > 1500
    assert sum(case.exact for case in all_cases) > 300


@pytest.fixture
def walk_aliases(tiny_model_dir, minilm_folder):
    register_alias(name="minilm", folder="all-minilm-l6-v2", concurrency=4)
    return register_alias(name="tiny", folder="tiny-llama", max_tokens=1, max_output_tokens=1)


async def _answer(response) -> tuple[int, dict[str, Any] | None, str | None]:
    """(status, the error object or None, what is wrong with the body or None)."""
    if response.streaming:
        raw = b"".join([chunk async for chunk in response.streaming_content])
        if response["Content-Type"] != "text/event-stream":
            return response.status_code, None, f"a stream of {response['Content-Type']}"
        for line in raw.decode().split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[len("data: ") :])  # every event is JSON
        return response.status_code, None, None
    if response["Content-Type"] != "application/json":
        return response.status_code, None, f"a body of {response['Content-Type']}"
    body = json.loads(response.content)
    return response.status_code, body.get("error") if response.status_code >= 400 else None, None


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("surface", SURFACES, ids=[s.id for s in SURFACES])
async def test_every_field_with_every_json_type_over_http(surface, walk_aliases, api_key, mlx_engine):
    """API-4 (issue 25): never a 5xx or a body that is not JSON; a declared field of the wrong
    type is a 400 naming it; any refusal names the field it is in."""
    headers = {"Authorization": f"Bearer {api_key}", "anthropic-version": "2023-06-01"}
    client = AsyncClient()
    failures = []
    for case in cases(surface):
        response = await client.post(
            surface.path, data=json.dumps(case.body), content_type="application/json", headers=headers
        )
        status, error, wrong_body = await _answer(response)
        problem = wrong_body or check(surface, case, status, error)
        if problem:
            failures.append(f"{case}: {problem}")
    assert not failures, "\n".join(failures)


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(600)
async def test_every_field_with_every_json_type_over_the_websocket(walk_aliases, api_key, mlx_engine):
    """API-3, API-4: the same walk as `response.create` frames on one socket: an error frame
    with a 4xx naming the field, or a turn that ends; never a 5xx, and the socket stays open."""
    headers = [(b"host", b"testserver"), (b"authorization", f"Bearer {api_key}".encode())]
    socket = WebsocketCommunicator(application, "/ws/v1/responses", headers=headers)
    connected, _ = await socket.connect(timeout=10)
    assert connected
    failures = []
    for case in cases(RESPONSES):
        await socket.send_to(text_data=json.dumps({"type": "response.create", **case.body}))
        while True:
            frame = json.loads(await socket.receive_from(timeout=60))
            if frame["type"] == "error":
                status, error = frame["status"], frame["error"]
                break
            if frame["type"] in ("response.completed", "response.incomplete", "response.failed"):
                status, error = 200, None
                break
        problem = check(RESPONSES, case, status, error)
        if problem:
            failures.append(f"{case}: {problem}")
    await socket.disconnect()
    assert not failures, "\n".join(failures)


QUERY = [
    *[("limit", value) for value in ("\u00b2", "abc", "0", "101", "-1", "1.5", "", "1e2", "\u0661" * 4)],
    *[("order", value) for value in ("x", "", "ASC", "asc\u0000")],
    *[(name, value) for name in ("after", "before") for value in ("nope", "", "msg_" + "x" * 5000)],
]


@pytest.mark.django_db(transaction=True)
async def test_every_query_parameter_with_bad_values_is_a_400_naming_it(tiny_alias, api_key, mlx_engine):
    """API-4: the query of GET /v1/responses/{id}/input_items; "²" passed `str.isdigit` and
    then failed `int()`: a 500."""
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1}
    created = await AsyncClient().post(
        "/v1/responses", data=json.dumps(body), content_type="application/json", headers=headers
    )
    url = f"/v1/responses/{created.json()['id']}/input_items"
    for name, value in QUERY:
        response = await AsyncClient().get(url, {name: value}, headers=headers)
        assert response.status_code == 400, (name, value, response.content[:200])
        assert response.json()["error"]["param"] == name


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    # Words the serializers branch on, so the draws reach past the first check.
    | st.sampled_from(
        [
            "low",
            "none",
            "auto",
            "required",
            "any",
            "tool",
            "text",
            "json_schema",
            "json_object",
            "function",
            "message",
            "user",
            "assistant",
            "enabled",
        ]
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_json_anywhere_is_validated_or_refused_naming_its_field(data):
    """API-4: arbitrary JSON at any place of any surface's body is accepted, or refused with an
    `ApiError` 400 naming the field it is in; no other exception escapes validation."""
    surface = data.draw(st.sampled_from(SURFACES))
    base = data.draw(st.sampled_from(surface.bodies))
    path = data.draw(st.sampled_from(places(base)))
    case = Case(with_value(base, path, data.draw(JSON_VALUES)), path, "drawn", exact=False)
    try:
        validated(surface.serializer, case.body)
    except ApiError as exc:
        assert exc.status == 400
        error = {"param": exc.param, "message": exc.message}
        assert named(error, surface, case) is None, (str(case), exc.message)
