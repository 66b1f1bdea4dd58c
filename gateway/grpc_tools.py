"""Chat input over gRPC: `GenerateRequest`'s tools, chat messages, chat template variables and
own chat template into what gateway/tools.py and the chat template take, and a choice's
tool-call deltas into `GenerateChunk.tool_calls`.

The proto fields are turned into OpenAI's JSON form and checked by the same functions as REST
(`tool_calling_from_request`, `chat_messages`, `check_template_kwargs`), so both front doors
accept and refuse the same requests; only the field paths in the errors are this API's
(`tools.0.name`, not `tools.0.function.name`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from google.protobuf import struct_pb2

from gateway.errors import GatewayError
from gateway.openai_protocol import (
    ChatMessageIn,
    ToolCallFunction,
    ToolCallIn,
    chat_messages,
    check_template_kwargs,
)
from gateway.tools import ToolCalling, tool_calling_from_request
from protos.splitserve.v1 import gateway_pb2

_MODES = {gateway_pb2.TOOL_CHOICE_MODE_NONE: "none", gateway_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
          gateway_pb2.TOOL_CHOICE_MODE_REQUIRED: "required"}

# REST's field paths in the shared checks' errors → this API's.
_PATHS = ((re.compile(r"(?<![\w.])messages\.(?=\d)"), "chat.messages."),
          (re.compile(r"\b((?:tools|tool_calls)\.\d+)\.function\."), r"\1."))


def tool_calling_from_proto(request: gateway_pb2.GenerateRequest, parser: str | None
                            ) -> ToolCalling | None:
    """The request's `tools` / `tool_choice` / `parallel_tool_calls` (None: no tools, or
    tool_choice none without them). GatewayError (INVALID_ARGUMENT) naming the field when they
    are malformed, as REST's 400s, or sent with an input other than chat."""
    choice = _tool_choice(request.tool_choice) if request.HasField("tool_choice") else None
    if request.WhichOneof("input") != "chat" and (request.tools or choice not in (None, "none")):
        raise GatewayError.invalid("tools", "tools and tool_choice need chat input "
                                            "(chat.messages): tool calling is a chat feature")
    fields: dict[str, Any] = {"tools": [_tool(t, i) for i, t in enumerate(request.tools)],
                              "tool_choice": choice}
    if request.HasField("parallel_tool_calls"):
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    try:
        return tool_calling_from_request(fields, parser)
    except GatewayError as err:
        raise err.renamed(_grpc_paths) from None


def chat_messages_from_proto(messages: Sequence[gateway_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """`chat.messages` in the chat template's form, with an assistant's tool calls and a tool
    message's `tool_call_id` and `name` (checked as REST's `messages`)."""
    rest = [ChatMessageIn(
        role=m.role, content=m.content, name=m.name or None,
        tool_calls=[ToolCallIn(id=c.id, function=ToolCallFunction(name=c.name,
                                                                  arguments=c.arguments))
                    for c in m.tool_calls] or None,
        tool_call_id=m.tool_call_id or None) for m in messages]
    try:
        return chat_messages(rest)
    except GatewayError as err:
        raise err.renamed(_grpc_paths) from None


def template_kwargs_from_proto(request: gateway_pb2.GenerateRequest) -> dict[str, Any] | None:
    """The request's `chat_template_kwargs` as REST's (None: unset), checked by the same
    function. GatewayError (INVALID_ARGUMENT) naming the field when they are not allowed, or
    sent with an input other than chat."""
    if not request.HasField("chat_template_kwargs"):
        return None
    if request.WhichOneof("input") != "chat":
        raise GatewayError.invalid("chat_template_kwargs", "chat_template_kwargs need chat input "
                                   "(chat.messages): they are the chat template's variables")
    kwargs = {key: _json(value) for key, value in request.chat_template_kwargs.fields.items()}
    try:
        return check_template_kwargs(kwargs)
    except ValueError as err:
        raise GatewayError.invalid("chat_template_kwargs",
                                   f"chat_template_kwargs: {err}") from None


def chat_template_from_proto(request: gateway_pb2.GenerateRequest) -> str | None:
    """The request's own `chat_template` (None: unset), for chat input only; the rest of its
    checks are REST's (`Preprocessor.encode_chat`)."""
    if not request.HasField("chat_template"):
        return None
    if request.WhichOneof("input") != "chat":
        raise GatewayError.invalid("chat_template", "chat_template needs chat input "
                                   "(chat.messages): it renders the messages")
    return request.chat_template


def _json(value: struct_pb2.Value) -> Any:
    """A `Value` as the JSON value it stands for; a whole number as an int (a Struct holds every
    number as a double, JSON and REST keep `1` an integer)."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() else number
    if kind == "struct_value":
        return {k: _json(v) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_json(v) for v in value.list_value.values]
    return None if kind in (None, "null_value") else getattr(value, kind)


def call_deltas(calls: Sequence[dict[str, Any]]) -> list[gateway_pb2.ToolCallDelta]:
    """`OutputDelta.calls` (OpenAI's stream form) as proto deltas."""
    out = []
    for call in calls:
        function = call.get("function", {})
        out.append(gateway_pb2.ToolCallDelta(index=call["index"], id=call.get("id", ""),
                                             name=function.get("name", ""),
                                             arguments=function.get("arguments", "")))
    return out


def _tool(tool: gateway_pb2.Tool, i: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.HasField("description"):
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except json.JSONDecodeError as err:
            raise GatewayError.invalid(f"tools.{i}.parameters",
                                       f"tools.{i}.parameters is not JSON: {err}") from None
    return {"type": "function", "function": function}


def _tool_choice(choice: gateway_pb2.ToolChoice) -> str | dict[str, Any] | None:
    """OpenAI's `tool_choice` (None: unset, auto with tools)."""
    if choice.WhichOneof("choice") == "function_name":
        return {"type": "function", "function": {"name": choice.function_name}}
    if choice.mode == gateway_pb2.TOOL_CHOICE_MODE_UNSPECIFIED:
        return None
    if choice.mode not in _MODES:
        raise GatewayError.invalid("tool_choice.mode", f"tool_choice.mode {choice.mode} is not "
                                   "one of NONE (1), AUTO (2), REQUIRED (3)")
    return _MODES[choice.mode]


def _grpc_paths(text: str) -> str:
    """REST's field paths in `text` as this API names them."""
    for pattern, replacement in _PATHS:
        text = pattern.sub(replacement, text)
    return text
