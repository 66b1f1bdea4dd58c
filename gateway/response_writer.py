"""A Responses API response built from the chat deltas of its one choice (`ResponseWriter`):
its output items — a `reasoning` item, a `message` with one `output_text` part, `function_call`
items — either whole or as the stream's events (`response.created` … `response.completed`, each
with its `sequence_number`), one writer for both so the two agree."""

from __future__ import annotations

import time
from typing import Any, Literal

from gateway.responses_api import ResponsesRequest, new_id


class ResponseWriter:
    """A response's output items from the chat deltas of its one choice, and the stream's events
    on the way (`start`, `delta`, `finish`); the finished object is `response`."""

    def __init__(self, req: ResponsesRequest, model: str, *, store: bool) -> None:
        self.id = new_id("resp")
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item deltas are going to
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.response: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": (req.parallel_tool_calls
                                    if req.parallel_tool_calls is not None else True),
            "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": store,
            "truncation": "disabled", "usage": None}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def error(self, message: str, code: str | int, param: str | None) -> dict[str, Any]:
        """The stream's event for a failure after it started."""
        return self._event("error", code=str(code), message=message, param=param)

    def start(self) -> list[dict[str, Any]]:
        snapshot = dict(self.response)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events of one chat delta (`reasoning`, `content`, `tool_calls`)."""
        out: list[dict[str, Any]] = []
        if delta.get("reasoning"):
            item = self._item(out, "reasoning")
            item["content"][0]["text"] += delta["reasoning"]
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                   output_index=self._index(item), content_index=0,
                                   delta=delta["reasoning"]))
        if delta.get("content"):
            item = self._item(out, "message")
            item["content"][0]["text"] += delta["content"]
            out.append(self._event("response.output_text.delta", item_id=item["id"],
                                   output_index=self._index(item), content_index=0,
                                   delta=delta["content"], logprobs=[]))
        for part in delta.get("tool_calls") or []:
            call = self._calls.get(part["index"])
            if call is None:
                self._close(out)
                self._close_calls(out)
                call = self._calls[part["index"]] = self._add(out, {
                    "type": "function_call", "id": new_id("fc"), "call_id": part.get("id"),
                    "name": part["function"].get("name", ""), "arguments": "",
                    "status": "in_progress"})
            args = part["function"].get("arguments") or ""
            if args:
                call["arguments"] += args
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=call["id"], output_index=self._index(call),
                                       delta=args))
        return out

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events; `response` is then the finished object."""
        out: list[dict[str, Any]] = []
        self._close(out)
        self._close_calls(out)
        incomplete = finish_reason == "length"
        self.response.update(
            status="incomplete" if incomplete else "completed", output=list(self._items),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={"input_tokens": usage["prompt_tokens"],
                   "input_tokens_details": {"cached_tokens": (usage.get(
                       "prompt_tokens_details") or {}).get("cached_tokens", 0)},
                   "output_tokens": usage["completion_tokens"],
                   "output_tokens_details": {"reasoning_tokens": (usage.get(
                       "completion_tokens_details") or {}).get("reasoning_tokens", 0)},
                   "total_tokens": usage["total_tokens"]})
        kind = "response.incomplete" if incomplete else "response.completed"
        out.append(self._event(kind, response=self.response))
        return out

    # -- items
    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self._items) if it is item)

    def _add(self, out: list[dict[str, Any]], item: dict[str, Any]) -> dict[str, Any]:
        self._items.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self._items) - 1,
                               item=_copy(item)))
        return item

    def _item(self, out: list[dict[str, Any]], kind: Literal["reasoning", "message"]
              ) -> dict[str, Any]:
        """The open item of `kind`, opened (and the ones before closed) if need be."""
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close(out)
        self._close_calls(out)
        if kind == "reasoning":
            item = self._add(out, {"type": "reasoning", "id": new_id("rs"), "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}],
                                   "status": "in_progress"})
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=self._index(item), content_index=0,
                                   part={"type": "reasoning_text", "text": ""}))
        else:
            item = self._add(out, {"type": "message", "id": new_id("msg"), "role": "assistant",
                                   "status": "in_progress", "content": [
                                       {"type": "output_text", "text": "", "annotations": [],
                                        "logprobs": []}]})
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=self._index(item), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": [],
                                         "logprobs": []}))
        self._open = item
        return item

    def _close(self, out: list[dict[str, Any]]) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        part = item["content"][0]
        index = self._index(item)
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=part["text"]))
        else:
            out.append(self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=part["text"],
                                   logprobs=[]))
        out.append(self._event("response.content_part.done", item_id=item["id"],
                               output_index=index, content_index=0, part=_copy(part)))
        self._done(out, item)

    def _close_calls(self, out: list[dict[str, Any]]) -> None:
        for item in self._calls.values():
            if item["status"] == "in_progress":
                self._done(out, item)

    def _done(self, out: list[dict[str, Any]], item: dict[str, Any]) -> None:
        item["status"] = "completed"
        index = self._index(item)
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"],
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index,
                               item=_copy(item)))


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (later deltas must not change what was sent)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
