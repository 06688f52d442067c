"""A real agent framework drives a tool loop against the server: the OpenAI Agents SDK, through
its chat-completions model and its Responses model, with the tool choice forced, so the tiny
model's call always validates; the SDK parses it, runs the Python tool and stops on its result."""

from __future__ import annotations

from typing import Literal

import pytest
from serverkit import MODEL, Stack

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def stack():
    served = Stack(in_process=True)
    yield served
    served.close()


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_agent_runs_a_tool_the_model_calls(stack, api):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    model = (agents.OpenAIChatCompletionsModel(MODEL, client) if api == "chat_completions"
             else agents.OpenAIResponsesModel(MODEL, client))
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                       max_tokens=128, temperature=0))
    result = agents.Runner.run_sync(agent, "What is the weather in Rome?")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome", "Oslo")
    assert result.final_output == f"sunny in {calls[0]}"
