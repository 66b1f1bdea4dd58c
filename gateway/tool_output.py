"""A choice's text turned into content and tool calls, delta by delta (`ToolOutput`): the
calls made so far (`Calls`), and the outputs of the constrained tool choices — a named function
(`NamedOutput`) or `"required"` (`RequiredOutput`). The `auto` parsers are gateway/tool_parsers.py.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


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


class Calls:
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


def call_arguments(value: object) -> str | None:
    """A call's arguments as the JSON text OpenAI sends (None: not an object)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


class NamedOutput(Calls):
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


class RequiredOutput(Calls):
    """`tool_choice: "required"`: the output is a JSON array of `{name, parameters}` (constrained);
    each element becomes a call once it is complete. Text left when the array did not close
    (max_tokens) is content."""

    def __init__(self) -> None:  # parallel_tool_calls is the constraint's (maxItems)
        super().__init__()
        self._buf = ""
        self._pos = 0          # where the next element (or the closing bracket) starts
        self._opened = False
        self._closed = False
        self._decode = ObjectDecoder()

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
            args = call_arguments(value.get("parameters")) if isinstance(value, dict) else None
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


class ObjectDecoder:
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
