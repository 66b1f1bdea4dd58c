"""The `auto` tool-call parsers (the gateway's `--tool-call-parser`): the model writes what it
likes, and its tool calls are parsed out of the text — `hermes` (`<tool_call>{...}</tool_call>`
blocks) or `llama3_json` (JSON objects separated by `;`). Streamed (`incremental`), a call is sent
as soon as its name is known and then its arguments' text as the model writes it."""

from __future__ import annotations

import json
import re
from typing import Literal

from engine_api.detokenizer import holdback
from gateway.tool_output import Calls, ObjectDecoder, OutputDelta, call_arguments


class _AutoOutput(Calls):
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

class _CallStream:
    """One call object `{"name": "...", "<arguments key>": {...}, ...}` arriving in pieces: its
    name once the arguments' `{` follows it, then the arguments' text up to the end of that
    object (found by `ObjectDecoder`, so a `}` inside a string does not end it). An object that
    starts otherwise (another key first, arguments that are not an object) never opens: its
    parser takes it whole when it ends."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        keys = "|".join(re.escape(k) for k in args_keys)
        self._head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:'
                                + keys + r')"\s*:\s*(?=\{)')
        self._decode = ObjectDecoder()
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
            args = call_arguments(obj[key])
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
        self._decode = ObjectDecoder()
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
