"""End to end: agent clients, unmodified, against a real daphne (API-6..8).

The agent frameworks run on the demo model (SmolLM2-135M, real weights): their tools take free
strings, which only a real model ends sensibly. The shape checks run on the tiny random model
with bounded schemas. Neither model has a tool format in its template, so every call here is
forced (`tool_choice`) or a JSON format, which the grammar makes valid on any model.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast.",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=99)


@pytest.fixture
def oai(daphne_server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0, timeout=90)


@pytest.fixture
def claude(daphne_server, api_key) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daphne_server.url, api_key=api_key, max_retries=0, timeout=90)


def test_openai_named_tool_choice_gives_arguments_that_validate(oai, tiny_alias):
    for stream in (False, True):
        kwargs = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "max_tokens": 80, "temperature": 1.0}
        choice = {"type": "function", "function": {"name": "get_weather"}}
        if stream:
            with oai.chat.completions.stream(**kwargs, tool_choice=choice) as events:
                completion = events.get_final_completion()
        else:
            completion = oai.chat.completions.create(**kwargs, tool_choice=choice)
        (call,) = completion.choices[0].message.tool_calls
        assert completion.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_openai_parse_with_a_pydantic_schema_streamed_and_not(oai, tiny_alias):
    kwargs = {
        "model": "tiny",
        "messages": ASK,
        "response_format": Person,
        "max_tokens": 80,
        "temperature": 0.8,
    }
    parsed = oai.chat.completions.parse(**kwargs).choices[0].message.parsed
    assert isinstance(parsed, Person)
    with oai.chat.completions.stream(**kwargs) as events:
        streamed = events.get_final_completion().choices[0].message.parsed
    assert isinstance(streamed, Person)


def test_openai_logprobs(oai, tiny_alias):
    completion = oai.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=4, logprobs=True, top_logprobs=5
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert all(len(t.top_logprobs) == 5 and t.logprob <= 0 for t in content)


def test_openai_responses_tool_chain_continues_by_previous_response_id(oai, tiny_alias):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}
    first = oai.responses.create(
        model="tiny",
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    answer = oai.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "4 degrees"}],
        tools=[tool],
        max_output_tokens=8,
    )
    assert answer.status in ("completed", "incomplete")
    more = oai.responses.create(
        model="tiny", previous_response_id=answer.id, input="And tomorrow?", tools=[tool], max_output_tokens=8
    )
    assert more.output_text is not None
    assert more.usage.input_tokens > answer.usage.input_tokens  # the whole chain, calls included


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_stop_on_first_tool(daphne_server, api_key, demo_alias, api):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The forecast for a city."""
        calls.append((city, days))
        return f"Sunny in {city} for {days} days"

    client = openai.AsyncOpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0)
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="forecaster",
        instructions="Use the tool.",
        tools=[get_weather],
        model=model_class(model="smollm2", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=80),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "Weather in Oslo for 2 days?"))
    assert len(calls) == 1
    assert result.final_output == f"Sunny in {calls[0][0]} for {calls[0][1]} days"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(daphne_server, api_key, demo_alias, method):
    """json_mode (any JSON object) is served too (tests/api/test_tools_chat.py); on a 135M model an
    unbounded object can run to max_tokens, so it is no stable end-to-end check."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="smollm2", base_url=f"{daphne_server.url}/v1", api_key=api_key, max_tokens=80, max_retries=0
    )
    result = llm.with_structured_output(Person, method=method).invoke("Who is Ada?")
    assert isinstance(result, Person)


def test_langchain_bind_tools_gives_tool_calls(daphne_server, api_key, demo_alias):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The forecast for a city."""
        return "sunny"

    llm = ChatOpenAI(
        model="smollm2", base_url=f"{daphne_server.url}/v1", api_key=api_key, max_tokens=80, max_retries=0
    )
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}


def test_anthropic_forced_tool_streamed_and_continued(claude, tiny_alias):
    tool = {"name": "get_weather", "description": "The forecast.", "input_schema": WEATHER_SCHEMA}
    kwargs = {
        "model": "tiny",
        "max_tokens": 80,
        "messages": ASK,
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    (streamed,) = final.content
    assert streamed.type == "tool_use" and streamed.name == "get_weather"
    jsonschema.validate(streamed.input, WEATHER_SCHEMA)
    reply = claude.messages.create(
        model="tiny",
        max_tokens=8,
        tools=[tool],
        messages=[
            *ASK,
            {"role": "assistant", "content": [block.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}],
            },
        ],
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_langchain_anthropic_structured_output(daphne_server, api_key, demo_alias):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        model="smollm2", base_url=daphne_server.url, api_key=api_key, max_tokens=80, max_retries=0
    )
    result = llm.with_structured_output(Person).invoke("Who is Ada?")
    assert isinstance(result, Person)
