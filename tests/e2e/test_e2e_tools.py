"""Tool calling through the whole disaggregated stack (real SmolLM2 workers, a real gateway
started with `--tool-call-parser hermes` and the bundled ChatML tools template, the unmodified
`openai` client): a named function and `"required"` come back as tool calls whose arguments
match the tools' schemas, streamed deltas add up to the non-streamed message, `"auto"` parses
the model's `<tool_call>` blocks (the model is made to write one with a regex constraint:
SmolLM2-135M rarely calls a tool by itself), earlier calls and their results reach the prompt,
and what cannot work is refused with a 400."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import BadRequestError, OpenAI  # noqa: E402

from gateway.server import GatewayServer  # noqa: E402
from tests.support.e2e_stack import FORCED_CALL, HOST, MODEL_NAME, TIME, WEATHER, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def tools_gateway(tools_gateway_server: GatewayServer) -> str:
    """The tool-calling gateway's REST base URL."""
    return f"http://{HOST}:{tools_gateway_server.rest_port}/v1"


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)


def _create(url: str, **kw: Any) -> Any:
    opts: dict[str, Any] = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS,
                            "temperature": 0, "max_tokens": 120} | kw
    return _client(url).chat.completions.create(**opts)


def _streamed(url: str, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls as {id, name, arguments}, finish reason) rebuilt from a stream."""
    content, calls, finish = "", {}, None
    for chunk in _create(url, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": "",
                                                 "parts": 0})
            call["id"] = part.id or call["id"]
            call["parts"] += 1
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _calls(message: Any) -> list[dict[str, Any]]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str), args
    assert args["unit"] in ("celsius", "fahrenheit")


def _same_calls(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [(c["name"], c["arguments"]) for c in a] == [(c["name"], c["arguments"]) for c in b]
    assert all(c["id"].startswith("call_") for c in a + b)


def test_named_function(tools_gateway: str) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = _create(tools_gateway, tool_choice=choice)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop"  # OpenAI: a named call stops
    assert message.content is None
    calls = _calls(message)
    assert [c["name"] for c in calls] == ["get_weather"]
    _check_weather(calls[0]["arguments"])
    content, streamed, finish = _streamed(tools_gateway, tool_choice=choice)
    assert (content, finish) == ("", "stop")
    _same_calls(streamed, calls)


def test_required(tools_gateway: str, disagg_stack: Stack) -> None:
    resp = _create(tools_gateway, tool_choice="required")
    assert resp.choices[0].finish_reason == "tool_calls"
    calls = _calls(resp.choices[0].message)
    assert calls, resp
    for call in calls:
        assert call["name"] in ("get_weather", "get_time")
        if call["name"] == "get_weather":
            _check_weather(call["arguments"])
    content, streamed, finish = _streamed(tools_gateway, tool_choice="required")
    assert (content, finish) == ("", "tool_calls")
    _same_calls(streamed, calls)
    single = _create(tools_gateway, tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1
    disagg_stack.wait_idle()


def test_auto_parses_the_models_calls(tools_gateway: str) -> None:
    forced = {"extra_body": {"structured_outputs": {"regex": FORCED_CALL}}}
    resp = _create(tools_gateway, **forced)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    calls = _calls(message)
    assert [c["name"] for c in calls] == ["get_weather"]
    _check_weather(calls[0]["arguments"])
    content, streamed, finish = _streamed(tools_gateway, **forced)
    assert (content, finish) == ("Let me check.", "tool_calls")
    _same_calls(streamed, calls)
    assert streamed[0]["parts"] > 3  # the arguments came as the model wrote them, not at the end
    # Without a call in the output, auto is plain chat: the text comes back as content.
    plain = _create(tools_gateway, max_tokens=12)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_earlier_calls_and_results_reach_the_prompt(tools_gateway: str) -> None:
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_7", "type": "function", "function": {
                       "name": "get_weather",
                       "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
               {"role": "tool", "tool_call_id": "call_7", "content": "21 degrees, sunny"}]
    base = tools_gateway.removesuffix("/v1")
    ids = httpx.post(f"{base}/tokenize", json={"messages": history, "tools": TOOLS},
                     timeout=30).json()["tokens"]
    text = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert '"name": "get_time"' in text  # the tools are shown
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>') in text
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in text
    resp = _create(tools_gateway, messages=history, tool_choice="none", max_tokens=16)
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content


def test_refusals(tools_gateway: str, disagg_stack: Stack) -> None:
    def refused(url: str, **kw: Any) -> str:
        with pytest.raises(BadRequestError) as err:
            _create(url, **kw)
        return str(err.value)

    # The stack's own gateway was started without --tool-call-parser.
    assert "--tool-call-parser" in refused(disagg_stack.rest_url, tool_choice="auto")
    assert "not among the tools" in refused(
        tools_gateway, tool_choice={"type": "function", "function": {"name": "launch"}})
    assert "cannot be combined" in refused(tools_gateway, tool_choice="required",
                                           response_format={"type": "json_object"})
    assert "1-64 letters" in refused(tools_gateway, tools=[
        {"type": "function", "function": {"name": "no spaces please"}}])
    # A parameters schema that does not compile is the workers' check: a 400 all the same.
    assert "does not compile" in refused(
        tools_gateway, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}])
    metrics = httpx.get(tools_gateway.removesuffix("/v1") + "/metrics", timeout=30).text
    # Labels in the exposition's (alphabetical) order.
    assert (f'splitserve:tool_call_requests_total{{model_name="{MODEL_NAME}",'
            'tool_choice="required"}') in metrics
    disagg_stack.wait_idle()
