"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's `<think>…</think>` text
comes back apart from its answer, as the message's `reasoning` (and `reasoning_content`, the
name SGLang and DeepSeek's API use).

- `deepseek_r1`: the output is reasoning from its start (the template opened `<think>` in the
  prompt; a `<think>` the model writes itself is dropped) up to `</think>`; without one, all of
  it is reasoning (cut short while thinking).
- `qwen3`: reasoning when the output starts with `<think>` (Qwen3 writes it) or when the prompt
  left one open (Qwen3-2507 thinking and later templates put it there); otherwise, e.g. with
  `chat_template_kwargs: {"enable_thinking": false}` (the template closes an empty block in the
  prompt), the whole output is content.

Whitespace between `</think>` and the answer is dropped. One `ReasoningSplitter` per choice
turns text deltas into reasoning and content deltas; the content goes on to a tool-call parser
when the request has tools (`ChatOutput`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engine_api.detokenizer import holdback
from gateway.config import REASONING_PARSERS
from gateway.tool_output import ToolOutput

START, END = "<think>", "</think>"
# Prompt tokens read back to find whether the template left a <think> open.
_PROMPT_TAIL_TOKENS = 64


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def prompt_reasoning(tokenizer: _Decoder, prompt_ids: Sequence[int]
                     ) -> Literal["open", "closed"] | None:
    """Where the rendered prompt leaves the model's reasoning: "open" (it ends inside a
    `<think>` block: the model answers in it), "closed" (it ends with `</think>`: the template
    closed an empty block, Qwen3's `enable_thinking: false`), else None."""
    tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    if tail.rfind(START) > tail.rfind(END):
        return "open"
    return "closed" if tail.rstrip().endswith(END) else None


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One choice's output → reasoning and content, delta by delta (see the module)."""

    def __init__(self, parser: str, prompt_opens: bool) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
        opens = parser == "deepseek_r1" or prompt_opens
        # "start": reasoning, a leading <think> not yet ruled out; "undecided": content unless
        # the output starts with <think>.
        self._mode: Literal["start", "undecided", "reasoning", "content"] = (
            "start" if opens else "undecided")
        self._buf = ""
        self._content_started = False
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.entered = opens  # whether any of the output is reasoning
        self.closed = False   # whether its </think> came

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        while self._buf:
            if self._mode in ("start", "undecided"):
                head = self._buf.lstrip()
                if head.startswith(START):
                    self._mode, self._buf, self.entered = "reasoning", head[len(START):], True
                    continue
                if START.startswith(head):
                    break  # blank so far, or a start of the tag
                self._mode = "reasoning" if self._mode == "start" else "content"
                continue
            if self._mode == "reasoning":
                end = self._buf.find(END)
                if end < 0:
                    keep = holdback(self._buf, (END,))
                    self._reasoning(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._reasoning(self._buf[:end], out)
                self._mode, self._buf = "content", self._buf[end + len(END):]
                self.closed = True
                continue
            self._content(self._buf, out)
            self._buf = ""
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._mode == "reasoning" or (self._mode == "start" and self._buf):
            self._reasoning(self._buf, out)  # cut short while thinking
        elif self._buf:
            self._content(self._buf, out)  # blank, or a start of <think> that never came
        self._buf = ""
        return out

    def _reasoning(self, text: str, out: ReasoningDelta) -> None:
        if text:
            self.reasoning_parts.append(text)
            out.reasoning += text

    def _content(self, text: str, out: ReasoningDelta) -> None:
        if not self._content_started and self.entered:
            text = text.lstrip()  # the whitespace after </think>
        if text:
            self._content_started = True
            self.content_parts.append(text)
            out.content += text

    @property
    def reasoning(self) -> str | None:
        return "".join(self.reasoning_parts) if self.entered else None


def reasoning_token_count(tokenizer: _Decoder, output_ids: Sequence[int], texts: Sequence[str],
                          sizes: Sequence[int], splitter: ReasoningSplitter,
                          held_back: bool = False) -> int:
    """How many of a finished choice's output tokens are its reasoning (OpenAI's
    `reasoning_tokens`): up to and including the token that completes the first `</think>`, all
    of them when the block never closed, none when there was none. `texts` and `sizes`: the
    output's text deltas and the tokens each came with. Each token's text comes with it (ASCII
    tags are never held as part of a character), so the delta whose text completes the tag
    holds that token: only a delta of several tokens decodes a few prefixes to find which.
    `held_back`: the detokenizer may have held text back for a stop string, so any earlier
    token may be the one (the whole output is searched: log2(n) decodes)."""
    if not splitter.entered:
        return 0
    end = "".join(texts).find(END)
    if not splitter.closed or end < 0:
        return len(output_ids)
    end += len(END)
    lo, hi = 1, len(output_ids)
    if not held_back:
        seen_text = seen_tokens = 0
        for text, n in zip(texts, sizes, strict=True):
            if seen_text + len(text) >= end:
                lo, hi = seen_tokens + 1, seen_tokens + n
                break
            seen_text += len(text)
            seen_tokens += n
    while lo < hi:  # containment only grows with the prefix
        mid = (lo + hi) // 2
        if END in tokenizer.decode(list(output_ids[:mid]), skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(slots=True)
class ChatDelta:
    """What one text delta of a chat choice became."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutput:
    """A chat choice's text through the gateway's parsers: reasoning split off first (when a
    reasoning parser is set), then the rest through the tool-call parser (when the request has
    tools); otherwise it is content. The non-streamed message is the deltas joined."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolOutput | None) -> None:
        self.splitter = reasoning
        self.tools = tools
        self._content: list[str] = []
        # The output's text deltas and their tokens (`note`), for `reasoning_tokens`.
        self._ids: list[int] = []
        self._texts: list[str] = []
        self._sizes: list[int] = []

    def note(self, text: str, token_ids: Sequence[int]) -> None:
        """One of the output's deltas as the engine sent it (kept only with a reasoning parser,
        to count reasoning tokens; parsing is `feed`'s, which may take the text whole)."""
        if self.splitter is not None:
            self._ids.extend(token_ids)
            self._texts.append(text)
            self._sizes.append(len(token_ids))

    def feed(self, text: str) -> ChatDelta:
        return self._through(self.splitter.feed(text) if self.splitter else
                             ReasoningDelta(content=text), finish=False)

    def reasoning_tokens(self, tokenizer: _Decoder, held_back: bool) -> int:
        """`reasoning_token_count` over the noted deltas (0 without a parser)."""
        if self.splitter is None:
            return 0
        return reasoning_token_count(tokenizer, self._ids, self._texts, self._sizes,
                                     self.splitter, held_back)

    def finish(self) -> ChatDelta:
        split = self.splitter.finish() if self.splitter else ReasoningDelta()
        return self._through(split, finish=True)

    def _through(self, split: ReasoningDelta, finish: bool) -> ChatDelta:
        out = ChatDelta(reasoning=split.reasoning)
        if self.tools is None:
            out.content = split.content
            self._content.append(split.content)
            return out
        delta = self.tools.feed(split.content) if split.content else None
        for d in (delta, self.tools.finish() if finish else None):
            if d is not None:
                out.content += d.content
                out.calls += d.calls
        return out

    def message(self) -> dict[str, Any]:
        """The non-streamed response's message."""
        if self.tools is not None:
            message: dict[str, Any] = {"role": "assistant", "content": self.tools.content}
            if self.tools.tool_calls:
                message["tool_calls"] = self.tools.tool_calls
        else:
            message = {"role": "assistant", "content": "".join(self._content)}
        if self.splitter is not None:
            reasoning = self.splitter.reasoning
            message["reasoning"] = message["reasoning_content"] = reasoning
            if reasoning is not None and message["content"] == "" and "tool_calls" not in message:
                message["content"] = None  # all of it was reasoning (cut short)
        return message
