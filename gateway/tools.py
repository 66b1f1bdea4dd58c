"""Tool calling (OpenAI's `tools` / `tool_choice`): the request's side (here) and the output's
(gateway/tool_output.py, and the `auto` parsers in gateway/tool_parsers.py).

- `tool_calling_from_request` validates `tools`, `tool_choice` and `parallel_tool_calls`.
- A named function (`tool_choice: {"type": "function", ...}`) or `"required"` constrains the
  output (structured outputs, `tool_constraint`): the function's arguments as its parameters'
  JSON schema, or a non-empty JSON array of `{name, parameters}` objects, one per call. The
  output is a tool call whatever the model, as in vLLM.
- `"auto"` leaves the model free and parses what it writes with the gateway's
  `--tool-call-parser` (`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, as Hermes, Qwen 2.5/3 and SmolLM3 write them; `llama3_json`: a JSON object
  `{"name": ..., "parameters": {...}}`, several separated by `;`, as Llama 3.1-3.3 write them).
  The chat template must show the tools to the model (`--chat-template`, with
  `gateway/chat_templates/chatml_hermes_tools.jinja` for ChatML models).

One `ToolOutput` per choice turns the completion's text deltas into content deltas and tool-call
deltas; a non-streamed response is the same deltas joined, so the two forms agree. Streamed, the
`auto` parsers send a call as soon as its name is known and then its arguments' text as the
model writes it (`incremental`, as vLLM streams them); a call is then a call even if the model
breaks its JSON later. Not streamed, a call is parsed whole, and one that does not parse stays
content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from engine_api.sampling_params import SamplingParamsError, StructuredOutputs
from gateway.config import TOOL_CALL_PARSERS
from gateway.errors import GatewayError
from gateway.tool_output import NamedOutput, RequiredOutput, ToolOutput
from gateway.tool_parsers import HermesOutput, Llama3JsonOutput

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    spec: dict[str, Any]  # the request's entry, normalized, as chat templates receive it


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """What a request asked of tools. `mode`: none (tools shown, never called), auto (the model
    decides; parsed), required (at least one call, constrained), named (`name`, constrained)."""

    tools: tuple[Tool, ...]
    mode: ToolChoiceMode
    name: str | None = None
    parallel: bool = True
    parser: str | None = None  # auto: the gateway's --tool-call-parser

    def template_tools(self) -> list[dict[str, Any]]:
        """`tools` as transformers' chat templates take them."""
        return [t.spec for t in self.tools]

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def output(self, incremental: bool = False) -> ToolOutput:
        """A fresh parser of one choice's output (None-mode requests have no parser);
        `incremental`: `auto` calls are sent name first, then their arguments as they come
        (for a stream), not once whole."""
        if self.mode == "named":
            assert self.name is not None
            return NamedOutput(self.name)
        if self.mode == "required":
            return RequiredOutput()
        if self.mode == "auto":
            cls = HermesOutput if self.parser == "hermes" else Llama3JsonOutput
            return cls(self.parallel, incremental)
        raise ValueError(f"tool_choice {self.mode!r} has no tool-call output")


def tool_calling_from_request(extra: dict[str, Any], parser: str | None
                              ) -> ToolCalling | None:
    """`tools` / `tool_choice` / `parallel_tool_calls` of a chat request (None: no tools, or
    `tool_choice: "none"` without them). GatewayError (400) naming the field when malformed,
    when a named function is not among the tools, or when `auto` is asked of a gateway started
    without `--tool-call-parser`."""
    raw_tools = extra.get("tools")
    choice = extra.get("tool_choice")
    parallel = extra.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise GatewayError.invalid("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if raw_tools is None or raw_tools == []:
        if choice not in (None, "none"):
            raise GatewayError.invalid("tool_choice", "tool_choice needs tools: send the "
                                       "functions the model may call in `tools`")
        return None
    tools = _tools(raw_tools)
    mode, name = _tool_choice(choice, tools)
    if mode == "auto" and parser is None:
        raise GatewayError.invalid(
            "tool_choice", "tool_choice \"auto\" needs a gateway started with --tool-call-parser "
            f"({' or '.join(TOOL_CALL_PARSERS)}); \"required\", \"none\" or a named function "
            "work without one")
    return ToolCalling(tools, mode, name, parallel, parser if mode == "auto" else None)


def template_tools_from_request(extra: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A request's `tools`, validated, as the chat template takes them (vLLM's `/tokenize`
    renders them whatever `tool_choice` says)."""
    raw = extra.get("tools")
    return None if raw is None or raw == [] else [t.spec for t in _tools(raw)]


def _tools(raw: object) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        raise GatewayError.invalid("tools", "tools must be a list of {type: function, "
                                            "function: {name, description, parameters}}")
    if len(raw) > MAX_TOOLS:
        raise GatewayError.invalid("tools", f"at most {MAX_TOOLS} tools, got {len(raw)}")
    out: list[Tool] = []
    for i, entry in enumerate(raw):
        param = f"tools.{i}"
        if not isinstance(entry, dict) or entry.get("type") != "function" or \
                not isinstance(entry.get("function"), dict):
            raise GatewayError.invalid(param, f"{param} must be {{\"type\": \"function\", "
                                              f"\"function\": {{\"name\": ...}}}}")
        fn = entry["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise GatewayError.invalid(f"{param}.function.name",
                                       f"{param}.function.name must be 1-64 letters, digits, _ "
                                       f"or -, got {str(name)[:80]!r}")
        if any(t.name == name for t in out):
            raise GatewayError.invalid(f"{param}.function.name",
                                       f"{param}.function.name {name!r} is given twice")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise GatewayError.invalid(f"{param}.function.description",
                                       f"{param}.function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise GatewayError.invalid(f"{param}.function.parameters",
                                       f"{param}.function.parameters must be a JSON schema "
                                       f"object")
        spec_fn: dict[str, Any] = {"name": name}
        if description is not None:
            spec_fn["description"] = description
        if parameters is not None:
            spec_fn["parameters"] = parameters
        out.append(Tool(name, description, parameters, {"type": "function",
                                                         "function": spec_fn}))
    return tuple(out)


def _tool_choice(choice: object, tools: tuple[Tool, ...]) -> tuple[ToolChoiceMode, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None  # type: ignore[return-value]
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise GatewayError.invalid("tool_choice", f"tool_choice names function "
                                       f"{str(name)[:80]!r}, which is not among the tools")
        return "named", name
    raise GatewayError.invalid("tool_choice", "tool_choice must be \"none\", \"auto\", "
                               "\"required\" or {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}")


_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_constraint(calling: ToolCalling) -> StructuredOutputs | None:
    """The output constraint of a named or required tool choice (None for none / auto)."""
    if calling.mode == "named":
        assert calling.name is not None
        return _json_constraint(calling.tool(calling.name).parameters or _ANY_OBJECT)
    if calling.mode != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.name]},
                             "parameters": t.parameters or _ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in calling.tools]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not calling.parallel:
        array["maxItems"] = 1
    return _json_constraint(array)


def _json_constraint(schema: dict[str, Any]) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=json.dumps(schema))
    except SamplingParamsError as err:  # e.g. the schemas together past the size limit
        raise GatewayError.invalid("tools", f"tools: {err}") from None
