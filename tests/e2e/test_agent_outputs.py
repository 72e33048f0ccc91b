"""End to end: agents with tools and a typed final answer, through real clients (issue 25 §1).

openai-agents `Agent(tools=[...], output_type=Model)` on chat completions and Responses, and the
Vercel AI SDK's `generateText({tools, output: Output.object(...)})`, unmodified, against a real
daphne serving the demo model (SmolLM2-135M, real weights, no tool format in its template):
the tool runs, and the final output parses into the type.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

AI_SDK_PREFIX = ROOT / ".cache" / "ai-sdk"


class Forecast(BaseModel):
    city: str = Field(max_length=16)
    sunny: bool


async def _run(agent, prompt: str, *, stream: bool):
    from agents import Runner

    if not stream:
        return await Runner.run(agent, prompt, max_turns=3)
    result = Runner.run_streamed(agent, prompt, max_turns=3)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize(
    ("api", "stream"),
    [
        pytest.param("chat_completions", False, id="chat"),
        pytest.param("chat_completions", True, id="chat-streamed"),
        pytest.param("responses", False, id="responses"),
        pytest.param("responses", True, id="responses-streamed"),
    ],
)
def test_openai_agents_runs_the_tool_and_returns_the_output_type(
    daphne_server, api_key, demo_alias, api, stream
):
    """`Agent(tools=[...], output_type=Forecast)`: the forced call runs the tool; the turn after
    its result is decoded under the output type's schema, and the run ends with a Forecast."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
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
        instructions="Use the tool, then answer with the forecast.",
        tools=[get_weather],
        output_type=Forecast,
        model=model_class(model="smollm2", openai_client=client),
        # Forced on every turn: this 135M model, left to choose after the result, calls again.
        model_settings=ModelSettings(tool_choice="required", max_tokens=80),
        reset_tool_choice=False,
    )
    result = asyncio.run(_run(agent, "Weather in Oslo for 2 days?", stream=stream))
    assert len(calls) == 1
    assert isinstance(result.final_output, Forecast)


def test_openai_agents_with_auto_may_answer_in_the_type_at_once(daphne_server, api_key, demo_alias):
    """`auto`: the tools are offered beside the format (one grammar); this model answers the
    typed JSON at once, which the run returns as a Forecast."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The forecast for a city."""
        return f"Sunny in {city} for {days} days"

    client = openai.AsyncOpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0)
    agent = Agent(
        name="forecaster",
        instructions="Use the tool, then answer with the forecast.",
        tools=[get_weather],
        output_type=Forecast,
        model=OpenAIChatCompletionsModel(model="smollm2", openai_client=client),
        model_settings=ModelSettings(max_tokens=80),
    )
    result = asyncio.run(Runner.run(agent, "Weather in Oslo for 2 days?", max_turns=1))
    assert isinstance(result.final_output, Forecast)


@pytest.mark.parametrize("mode", ["forced", "auto"])
def test_vercel_ai_sdk_generate_text_with_tools_and_an_output(daphne_server, api_key, demo_alias, mode):
    """`generateText({tools, output: Output.object(...)})`. Forced first: the tool runs in the
    first step and the second step's text parses into the output schema. `auto`: the tools are
    offered beside the format, and this model answers in the schema at once."""
    if shutil.which("node") is None:
        if os.environ.get("MLXHOST_REQUIRE_SERVICES") == "1":
            pytest.fail("Node.js is not installed; CI needs it for the Vercel AI SDK")
        pytest.skip("Node.js is not installed")
    subprocess.run(["bash", str(ROOT / "scripts" / "ai_sdk.sh")], check=True, timeout=300)
    script = ROOT / "tests" / "e2e" / "js" / "agent.mjs"
    done = subprocess.run(
        ["node", str(script), f"{daphne_server.url}/v1", api_key, "smollm2", mode],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "AI_SDK_PREFIX": str(AI_SDK_PREFIX)},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if mode == "forced":
        assert len(result["calls"]) == 1 and result["steps"] == ["tool-calls", "stop"]
    else:
        assert result["steps"][-1] == "stop"
    Forecast.model_validate(result["output"])
