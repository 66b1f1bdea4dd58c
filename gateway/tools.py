"""Tool calling (OpenAI's `tools` / `tool_choice`): the request's side and the output's.

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
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engine_api.detokenizer import holdback
from engine_api.sampling_params import SamplingParamsError, StructuredOutputs
from gateway.config import TOOL_CALL_PARSERS
from gateway.errors import GatewayError

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


# -- the request -------------------------------------------------------------------------------
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


# -- the output --------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class OutputDelta:
    """What one text delta of a choice became: content, and tool-call deltas in the stream's
    form (`{"index", "id", "type", "function": {"name", "arguments"}}`, later parts of a call
    carrying only `index` and `function.arguments`)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolOutput(Protocol):
    """One choice's text → content and tool calls, delta by delta."""

    def feed(self, text: str) -> OutputDelta: ...

    def finish(self) -> OutputDelta: ...

    @property
    def content(self) -> str | None: ...

    @property
    def tool_calls(self) -> list[dict[str, Any]]: ...  # the message's form

    @property
    def finish_reason(self) -> str | None: ...  # "tool_calls" when it ends a stop in calls


class _Calls:
    """Tool calls made so far (the message's form) and the content around them."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.text: list[str] = []

    def call(self, name: str, arguments: str) -> dict[str, Any]:
        """Record a call (whole, or the start of its arguments); its stream delta."""
        call: dict[str, Any] = {"id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        # The delta's own `function`: the message's grows as later arguments arrive.
        return {"index": len(self.calls) - 1, **call, "function": dict(call["function"])}

    def more_arguments(self, text: str) -> dict[str, Any]:
        """Append to the last call's arguments; the stream delta."""
        self.calls[-1]["function"]["arguments"] += text
        return {"index": len(self.calls) - 1, "function": {"arguments": text}}

    @property
    def content(self) -> str | None:
        text = "".join(self.text)
        return None if self.calls and not text else text

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.calls


def _arguments(value: object) -> str | None:
    """A call's arguments as the JSON text OpenAI sends (None: not an object)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


class NamedOutput(_Calls):
    """`tool_choice` names a function: the whole output is its arguments (constrained), streamed
    as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> OutputDelta:
        if not text:
            return OutputDelta()
        if not self.calls:
            return OutputDelta(calls=[self.call(self._name, text)])
        return OutputDelta(calls=[self.more_arguments(text)])

    def finish(self) -> OutputDelta:
        if not self.calls:  # nothing generated (max_tokens reached at once): an empty call
            return OutputDelta(calls=[self.call(self._name, "")])
        return OutputDelta()

    @property
    def finish_reason(self) -> str | None:
        return None  # OpenAI ends a named call with "stop"


class RequiredOutput(_Calls):
    """`tool_choice: "required"`: the output is a JSON array of `{name, parameters}` (constrained);
    each element becomes a call once it is complete. Text left when the array did not close
    (max_tokens) is content."""

    def __init__(self) -> None:  # parallel_tool_calls is the constraint's (maxItems)
        super().__init__()
        self._buf = ""
        self._pos = 0          # where the next element (or the closing bracket) starts
        self._opened = False
        self._closed = False
        self._decode = _ObjectDecoder()

    def feed(self, text: str) -> OutputDelta:
        self._buf += text
        out = OutputDelta()
        while not self._closed:
            i = self._skip(self._pos)
            if i >= len(self._buf):
                break
            if not self._opened:
                if self._buf[i] != "[":
                    break  # the constraint makes this unreachable; finish() keeps the text
                self._opened, self._pos = True, i + 1
                continue
            if self._buf[i] == "]":
                self._closed, self._pos = True, i + 1
                break
            decoded = self._decode(self._buf, i)
            if decoded is None:
                break  # the element is not complete yet
            value, end = decoded
            args = _arguments(value.get("parameters")) if isinstance(value, dict) else None
            if args is None or not isinstance(value.get("name"), str):
                break
            out.calls.append(self.call(value["name"], args))
            self._pos = end
        return out

    def _skip(self, i: int) -> int:
        while i < len(self._buf) and (self._buf[i].isspace() or
                                      (self._opened and self._buf[i] == ",")):
            i += 1
        return i

    def finish(self) -> OutputDelta:
        rest = self._buf[self._skip(self._pos):].strip() if not self._closed else ""
        if rest:
            self.text.append(rest)
        return OutputDelta(content=rest)

    @property
    def finish_reason(self) -> str | None:
        return "tool_calls" if self.calls else None


class _AutoOutput(_Calls):
    """Shared by the `auto` parsers: content is streamed as it comes, except whitespace, which
    waits for the next text (whitespace around tool calls is dropped, as when the whole output
    is parsed at once) and a possible start of a tool call, which waits until it is one or
    not. Without `parallel`, calls after the first are dropped. `incremental`: a call's name is
    sent once known, then its arguments' text as it comes (`_CallStream`)."""

    def __init__(self, parallel: bool, incremental: bool = False) -> None:
        super().__init__()
        self._parallel = parallel
        self._incremental = incremental
        self._held_space = ""

    def _content(self, text: str, out: OutputDelta) -> None:
        if not text:
            return
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if body:
            self.text.append(body)
            out.content += body

    def _call(self, name: str, arguments: str, out: OutputDelta) -> None:
        if self._parallel or not self.calls:
            out.calls.append(self.call(name, arguments))

    def _stream_call(self, stream: _CallStream, text: str, out: OutputDelta) -> None:
        """Send what `stream` found new in `text` (the call object's text so far): the call's
        opening with its first arguments, then more arguments; nothing for a dropped call."""
        name, args = stream.advance(text)
        if name is not None:
            stream.dropped = not (self._parallel or not self.calls)
            if not stream.dropped:
                out.calls.append(self.call(name, args))
        elif args and not stream.dropped:
            out.calls.append(self.more_arguments(args))

    def _flush_space(self, out: OutputDelta) -> None:
        if self._held_space and not self.calls:
            self.text.append(self._held_space)
            out.content += self._held_space
        self._held_space = ""

    @property
    def finish_reason(self) -> str | None:
        return "tool_calls" if self.calls else None


class _ObjectDecoder:
    """`json.JSONDecoder.raw_decode` of a JSON object growing delta by delta: tried again only
    once a `}` has arrived since the last failure (an object can end only there), so a long
    call is not parsed from its start at every token."""

    def __init__(self) -> None:
        self._decoder = json.JSONDecoder()
        self._start = -1
        self._tried = 0  # the buffer's length at the last failed attempt at `_start`

    def __call__(self, buf: str, start: int) -> tuple[Any, int] | None:
        if start == self._start and "}" not in buf[self._tried:]:
            return None
        try:
            return self._decoder.raw_decode(buf, start)  # type: ignore[no-any-return]
        except json.JSONDecodeError:
            self._start, self._tried = start, len(buf)
            return None


class _CallStream:
    """One call object `{"name": "...", "<arguments key>": {...}, ...}` arriving in pieces: its
    name once the arguments' `{` follows it, then the arguments' text up to the end of that
    object (found by `_ObjectDecoder`, so a `}` inside a string does not end it). An object that
    starts otherwise (another key first, arguments that are not an object) never opens: its
    parser takes it whole when it ends."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        keys = "|".join(re.escape(k) for k in args_keys)
        self._head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:'
                                + keys + r')"\s*:\s*(?=\{)')
        self._decode = _ObjectDecoder()
        self.opened = False
        self.dropped = False  # opened, but not sent (a call after the first without parallel)
        self._args_start = -1  # where the arguments object starts, once opened
        self._sent = 0         # where the arguments' text not sent yet starts
        self.args_end = -1     # where the arguments object ends, once it has

    def advance(self, text: str) -> tuple[str | None, str]:
        """(the name, when it is first known; the arguments' text not sent before). `text`: the
        object's text so far, from its start (it may run past the object's end)."""
        name = None
        if not self.opened:
            m = self._head.match(text)
            if m is None:
                return None, ""
            try:
                name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return None, ""
            self.opened = True
            self._args_start = self._sent = m.end()
        if self.args_end < 0:
            decoded = self._decode(text, self._args_start)
            if decoded is not None:
                self.args_end = decoded[1]
        limit = self.args_end if self.args_end >= 0 else len(text)
        args = text[self._sent:limit] if limit > self._sent else ""
        self._sent = max(self._sent, limit)
        return name, args


def _named_call(obj: object, args_keys: tuple[str, ...], text: str | None = None
                ) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed `{"name": ..., <args key>: {...}}` object. `text`: the
    object's own text; the arguments are then as the model wrote them, as a stream sends them
    (`_CallStream`), when the object has that shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = _arguments(obj[key])
            if args is None:
                return None
            if text is not None:
                stream = _CallStream(args_keys)
                name, raw = stream.advance(text)
                if name == obj["name"] and stream.args_end >= 0 and json.loads(raw) == obj[key]:
                    args = raw
            return obj["name"], args
    return obj["name"], "{}"


class HermesOutput(_AutoOutput):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text outside them is
    content. Whole (not `incremental`), a block whose JSON does not parse stays content."""

    START, END = "<tool_call>", "</tool_call>"
    _ARGS_KEYS = ("arguments", "parameters")

    def __init__(self, parallel: bool, incremental: bool = False) -> None:
        super().__init__(parallel, incremental)
        self._buf = ""
        self._in_call = False
        self._searched = 0  # the block's text searched for END so far
        self._stream = _CallStream(self._ARGS_KEYS)

    def feed(self, text: str) -> OutputDelta:
        self._buf += text
        out = OutputDelta()
        while True:
            if self._in_call:
                end = self._buf.find(self.END, max(0, self._searched - len(self.END) + 1))
                self._searched = len(self._buf)
                if self._incremental:
                    inner = (self._buf[:end] if end >= 0 else
                             self._buf[:len(self._buf) - holdback(self._buf, (self.END,))])
                    self._stream_call(self._stream, inner, out)
                if end < 0:
                    break
                self._close(self._buf[:end], closed=True, out=out)
                self._buf = self._buf[end + len(self.END):]
                continue
            start = self._buf.find(self.START)
            if start >= 0:
                self._content(self._buf[:start], out)
                self._buf = self._buf[start + len(self.START):]
                self._in_call, self._searched = True, 0
                self._stream = _CallStream(self._ARGS_KEYS)
                continue
            keep = holdback(self._buf, (self.START,))
            self._content(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return out

    def _close(self, inner: str, closed: bool, out: OutputDelta) -> None:
        """The block ends: a call already sent stays one; otherwise it is parsed whole."""
        self._in_call = False
        if self._stream.opened:
            return
        try:
            parsed = _named_call(json.loads(inner), self._ARGS_KEYS, inner)
        except json.JSONDecodeError:
            parsed = None
        if parsed is None:
            self._content(self.START + inner + (self.END if closed else ""), out)
        else:
            self._call(*parsed, out)

    def finish(self) -> OutputDelta:
        out = OutputDelta()
        if self._in_call:
            if self._incremental:
                self._stream_call(self._stream, self._buf, out)  # a held-back tag start
            self._close(self._buf, closed=False, out=out)
        else:
            self._content(self._buf, out)
        self._buf = ""
        self._flush_space(out)
        return out


class Llama3JsonOutput(_AutoOutput):
    """Llama 3.x's JSON tool calls: the output (after an optional `<|python_tag|>`) is one JSON
    object `{"name": ..., "parameters": {...}}` or several separated by `;`, each a call once it
    is complete. Decided at the first non-blank character: anything but `{` is content,
    streamed from there; so is an object that is not a call, and what follows it."""

    TAG = "<|python_tag|>"
    _ARGS_KEYS = ("parameters", "arguments")

    def __init__(self, parallel: bool, incremental: bool = False) -> None:
        super().__init__(parallel, incremental)
        self._buf = ""
        self._pos = 0
        self._mode: Literal["undecided", "calls", "text"] = "undecided"
        self._decode = _ObjectDecoder()
        self._stream: _CallStream | None = None  # the object after `_pos`, when incremental
        self._after_call = False  # `_pos` is past a call

    def feed(self, text: str) -> OutputDelta:
        out = OutputDelta()
        if self._mode == "text":
            self._content(text, out)
            return out
        self._buf += text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
            elif self.TAG.startswith(head):
                return out  # blank so far, or a start of the tag
            if not head:
                return out
            if head[0] != "{":
                self._to_text(0, out)
                return out
            self._mode, self._pos = "calls", len(self._buf) - len(head)
        self._calls(out)
        return out

    def _calls(self, out: OutputDelta) -> None:
        while self._mode == "calls":
            i = self._skip(self._pos)
            if self._after_call:  # `;` then the next, or the end
                if i >= len(self._buf):
                    return
                if self._buf[i] != ";":
                    self._to_text(self._pos, out)
                    return
                i = self._skip(i + 1)
            if i >= len(self._buf):
                return
            if self._buf[i] != "{":
                self._to_text(self._pos, out)
                return
            if self._incremental:
                if self._stream is None:
                    self._stream = _CallStream(self._ARGS_KEYS)
                self._stream_call(self._stream, self._buf[i:], out)
            decoded = self._decode(self._buf, i)
            if decoded is None:
                return  # not complete yet (finish() decides)
            obj, end = decoded
            sent, self._stream = self._stream is not None and self._stream.opened, None
            if not sent:
                call = _named_call(obj, self._ARGS_KEYS, self._buf[i:end])
                if call is None:
                    self._to_text(self._pos, out)
                    return
                self._call(*call, out)
            self._pos, self._after_call = end, True

    def _skip(self, i: int) -> int:
        while i < len(self._buf) and self._buf[i].isspace():
            i += 1
        return i

    def _to_text(self, start: int, out: OutputDelta) -> None:
        self._mode = "text"
        self._content(self._buf[start:], out)
        self._buf = ""

    def finish(self) -> OutputDelta:
        out = OutputDelta()
        sent = self._stream is not None and self._stream.opened  # cut short: it stays a call
        if self._mode != "text" and not sent and self._buf[self._pos:].strip():
            self._to_text(self._pos, out)  # an object that never completed
        self._buf = ""
        self._flush_space(out)
        return out
