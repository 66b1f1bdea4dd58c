"""Tool calling over the gateway's gRPC API (`Gateway.Generate` with `tools`, `tool_choice`,
`parallel_tool_calls`), against the real SmolLM2 workers and the tool-calling gateway of
test_e2e_tools.py (`--tool-call-parser hermes`, the ChatML tools template): a named function
and `required` come back as tool-call deltas whose arguments match the schema (the same call as
over REST), `auto` parses the model's `<tool_call>` block while the token ids stay the model's,
earlier calls and tool results render as over REST, and bad tool input is INVALID_ARGUMENT."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from gateway.grpc_tools import call_deltas, tool_calling_from_proto  # noqa: E402
from gateway.server import GatewayServer  # noqa: E402
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import FORCED_CALL, HOST, MODEL_NAME, TIME, WEATHER, Stack, generate  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
ASK = "What is the weather like in Paris today?"
NAMED = gateway_pb2.ToolChoice(function_name="get_weather")
REQUIRED = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED)
NONE = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_NONE)
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": ASK},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
    {"role": "tool", "tool_call_id": "call_7", "name": "get_weather",
     "content": "21 degrees, sunny"}]


def _tool(spec: dict[str, Any]) -> gateway_pb2.Tool:
    fn = spec["function"]
    return gateway_pb2.Tool(name=fn["name"], description=fn["description"],
                            parameters=json.dumps(fn["parameters"]))


TOOLS = [_tool(WEATHER), _tool(TIME)]


def _message(m: dict[str, Any]) -> gateway_pb2.ChatMessage:
    calls = [gateway_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                  arguments=c["function"]["arguments"])
             for c in m.get("tool_calls", [])]
    return gateway_pb2.ChatMessage(role=m["role"], content=m["content"] or "", tool_calls=calls,
                                   tool_call_id=m.get("tool_call_id", ""), name=m.get("name", ""))


def _chat(messages: list[dict[str, Any]]) -> gateway_pb2.ChatMessages:
    return gateway_pb2.ChatMessages(messages=[_message(m) for m in messages])


ASK_CHAT = _chat([{"role": "user", "content": ASK}])


@pytest.fixture(scope="module")
def stub(tools_gateway_server: GatewayServer) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with grpc.insecure_channel(f"{HOST}:{tools_gateway_server.grpc_port}") as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(scope="module")
def rest(tools_gateway_server: GatewayServer) -> str:
    return f"http://{HOST}:{tools_gateway_server.rest_port}"


@dataclass
class Reply:
    """One completion's stream, put together: content (the chunks' text), calls (id, name,
    arguments) from the deltas, the token ids, and the finish."""

    content: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_call_deltas: int = 0
    complete: gateway_pb2.GenerateComplete | None = None


def _generate(stub: gateway_pb2_grpc.GatewayStub, max_tokens: int, **fields: Any) -> Reply:
    fields = {"chat": ASK_CHAT, "tools": TOOLS, "skip_special_tokens": True} | fields
    fields = {name: value for name, value in fields.items() if value is not None}
    request = gateway_pb2.GenerateRequest(
        sampling=fields.pop("sampling", common_pb2.SamplingParams(temperature=0,
                                                                   max_tokens=max_tokens)),
        **fields)
    reply = Reply()
    for response in stub.Generate(request, timeout=TIMEOUT_S):
        kind = response.WhichOneof("response")
        if kind == "error":
            continue  # the call's status follows (an RpcError)
        assert reply.complete is None, "a chunk after the completion's end"
        if kind == "complete":
            reply.complete = response.complete
            continue
        chunk = response.chunk
        reply.content += chunk.text
        reply.token_ids += chunk.token_ids
        for delta in chunk.tool_calls:
            reply.num_call_deltas += 1
            if delta.index == len(reply.calls):  # a new call: its first delta names it
                assert delta.id.startswith("call_") and delta.name, delta
                reply.calls.append({"id": delta.id, "name": delta.name, "arguments": ""})
            else:
                assert not delta.id and not delta.name, delta
            reply.calls[delta.index]["arguments"] += delta.arguments
    assert reply.complete is not None
    return reply


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str), args
    assert args["unit"] in ("celsius", "fahrenheit")


def _tool_metric(rest: str, choice: str) -> float:
    # Labels in the exposition's (alphabetical) order.
    line = (f'splitserve:tool_call_requests_total{{model_name="{MODEL_NAME}",'
            f'tool_choice="{choice}"}} ')
    for row in httpx.get(f"{rest}/metrics", timeout=30).text.splitlines():
        if row.startswith(line):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def test_named_function(stub: gateway_pb2_grpc.GatewayStub, rest: str,
                        disagg_stack: Stack) -> None:
    before = _tool_metric(rest, "named")
    reply = _generate(stub, 60, tool_choice=NAMED)
    assert reply.complete is not None
    assert reply.complete.finish_reason == common_pb2.FINISH_REASON_STOP  # as OpenAI's
    assert reply.content == ""
    assert [c["name"] for c in reply.calls] == ["get_weather"]
    _check_weather(reply.calls[0]["arguments"])
    # The whole output is the arguments: the token ids are the model's, unchanged.
    assert disagg_stack.tokenizer.decode(reply.token_ids) == reply.calls[0]["arguments"]
    assert _tool_metric(rest, "named") == before + 1
    # The same call as over REST (greedy).
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": ASK}],
            "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 60,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    message = httpx.post(f"{rest}/v1/chat/completions", json=body,
                         timeout=TIMEOUT_S).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == reply.calls[0]["arguments"]


def test_required_one_call_without_parallel(stub: gateway_pb2_grpc.GatewayStub,
                                            disagg_stack: Stack) -> None:
    reply = _generate(stub, 80, tool_choice=REQUIRED, parallel_tool_calls=False)
    assert reply.complete is not None
    assert reply.complete.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert reply.content == ""
    assert len(reply.calls) == 1, reply.calls  # maxItems 1
    call = reply.calls[0]
    assert call["name"] in ("get_weather", "get_time")
    if call["name"] == "get_weather":
        _check_weather(call["arguments"])
    assert json.loads(disagg_stack.tokenizer.decode(reply.token_ids)) == [
        {"name": call["name"], "parameters": json.loads(call["arguments"])}]
    disagg_stack.wait_idle()


def test_auto_parses_the_models_call(stub: gateway_pb2_grpc.GatewayStub,
                                     disagg_stack: Stack) -> None:
    forced = common_pb2.SamplingParams(
        temperature=0, max_tokens=60,
        structured_outputs=common_pb2.StructuredOutputs(regex=FORCED_CALL))
    reply = _generate(stub, 0, sampling=forced)  # tool_choice unset: auto
    assert reply.complete is not None
    assert reply.complete.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert reply.content == "Let me check."
    assert [c["name"] for c in reply.calls] == ["get_weather"]
    _check_weather(reply.calls[0]["arguments"])
    assert reply.num_call_deltas > 1  # a stream: the arguments come as the model writes them
    raw = disagg_stack.tokenizer.decode(reply.token_ids)  # the text is content, ids the model's
    assert raw.startswith("Let me check.\n<tool_call>\n") and raw.endswith("</tool_call>"), raw


def test_earlier_calls_and_results_render_as_over_rest(stub: gateway_pb2_grpc.GatewayStub,
                                                       rest: str, disagg_stack: Stack) -> None:
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reply = _generate(stub, 0, chat=_chat(HISTORY), tool_choice=NONE, sampling=sampling)
    assert reply.complete is not None and reply.complete.usage.completion_tokens == 8
    # The prompt REST renders from the same messages and tools gives the same tokens.
    ids = httpx.post(f"{rest}/tokenize", json={"messages": HISTORY, "tools": [WEATHER, TIME]},
                     timeout=30).json()["tokens"]
    assert reply.complete.usage.prompt_tokens == len(ids)
    by_ids = generate(disagg_stack.grpc_target, ids, 8)
    assert by_ids.token_ids == reply.token_ids
    body = {"model": MODEL_NAME, "messages": HISTORY, "tools": [WEATHER, TIME],
            "tool_choice": "none", "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    content = httpx.post(f"{rest}/v1/chat/completions", json=body,
                         timeout=TIMEOUT_S).json()["choices"][0]["message"]["content"]
    assert content == reply.content


def _invalid(stub: gateway_pb2_grpc.GatewayStub, **fields: Any) -> str:
    """Call and expect INVALID_ARGUMENT; returns the status message."""
    with pytest.raises(grpc.RpcError) as info:
        _generate(stub, 8, **fields)
    err: Any = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    return str(err.details())


def test_bad_tool_input_is_invalid_argument(stub: gateway_pb2_grpc.GatewayStub,
                                            disagg_stack: Stack) -> None:
    assert "tools.0.name must be 1-64 letters" in _invalid(
        stub, tools=[gateway_pb2.Tool(name="no spaces please")])
    assert "tools.1.parameters is not JSON" in _invalid(
        stub, tools=[TOOLS[0], gateway_pb2.Tool(name="f", parameters="{oops")])
    assert "tools.0.parameters must be a JSON schema object" in _invalid(
        stub, tools=[gateway_pb2.Tool(name="f", parameters="[]")])
    assert "not among the tools" in _invalid(
        stub, tool_choice=gateway_pb2.ToolChoice(function_name="launch"))
    assert "tool_choice needs tools" in _invalid(stub, tools=[], tool_choice=REQUIRED)
    assert "need chat input" in _invalid(stub, chat=None, text="hi")
    assert "cannot be combined" in _invalid(stub, tool_choice=REQUIRED, sampling=(
        common_pb2.SamplingParams(max_tokens=8,
                                  structured_outputs=common_pb2.StructuredOutputs(json_object=True))))
    user_call = [{"role": "user", "content": "hi", "tool_calls": HISTORY[1]["tool_calls"]}]
    assert "chat.messages.0.tool_calls: only assistant messages" in _invalid(
        stub, chat=_chat(user_call))
    bad_args = [HISTORY[0], {**HISTORY[1], "tool_calls": [
        {"id": "c", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    assert "chat.messages.1.tool_calls.0.arguments is not JSON" in _invalid(
        stub, chat=_chat(bad_args))
    # A parameters schema that does not compile is the workers' check: INVALID_ARGUMENT too.
    assert "does not compile" in _invalid(stub, tool_choice=REQUIRED, tools=[gateway_pb2.Tool(
        name="f", parameters=json.dumps({"type": "object", "properties": {
            "x": {"type": "string", "pattern": "("}}}))])
    # The stack's own gateway was started without --tool-call-parser: auto is refused.
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        plain = gateway_pb2_grpc.GatewayStub(channel)
        assert "--tool-call-parser" in _invalid(plain)
    disagg_stack.wait_idle()


def test_proto_defaults() -> None:
    """Unset parallel_tool_calls is true and unset tool_choice auto, as in OpenAI; the deltas
    keep OpenAI's stream form."""
    def calling(**fields: Any) -> Any:
        return tool_calling_from_proto(gateway_pb2.GenerateRequest(
            chat=ASK_CHAT, tools=TOOLS, **fields), "hermes")

    default = calling()
    assert (default.mode, default.parallel, default.parser) == ("auto", True, "hermes")
    assert calling(parallel_tool_calls=False).parallel is False
    assert calling(tool_choice=NONE).mode == "none"
    assert (calling(tool_choice=NAMED).mode, calling(tool_choice=NAMED).name) == (
        "named", "get_weather")
    assert tool_calling_from_proto(gateway_pb2.GenerateRequest(text="hi"), None) is None
    first, more = call_deltas([
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": "{"}},
        {"index": 0, "function": {"arguments": "}"}}])
    assert (first.index, first.id, first.name, first.arguments) == (0, "call_1", "f", "{")
    assert (more.id, more.name, more.arguments) == ("", "", "}")
