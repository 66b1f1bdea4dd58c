"""OpenAI's Responses API (`POST /v1/responses`) over the chat path, as vLLM and SGLang serve it.

A request becomes a chat completion request (`ResponsesRequest.chat_body`): `instructions` a
system message, `input` (a string, or items: messages with text parts, earlier
`function_call`s and their `function_call_output`s; a `reasoning` item's text goes with the
assistant turn after it as `reasoning_content`, for the template to show or drop),
`max_output_tokens`, function `tools` and
`tool_choice`, `text.format` as `response_format`, and vLLM's `chat_template_kwargs` and
`chat_template` (a request's own template, with --trust-request-chat-template). The chat
path's parsers (reasoning, tool calls) then shape the output, which `ResponseWriter`
(gateway/response_writer.py) turns into output items, whole or as the stream's events.

Stored responses (gateway/response_store.py): unless the request sets `store: false` (OpenAI's
default is to store) or the gateway stores nothing (`--responses-store-max-entries 0`: then
`store: true` is taken as false, as vLLM does without VLLM_ENABLE_RESPONSES_API_STORE), a
completed or incomplete response is kept with its conversation — its input items (`input_items`:
as the request gave them, with ids added) after those of its previous response, then its output
items; a failed or cancelled one is not. `GET` / `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items` read and drop them. `previous_response_id` puts the stored
conversation before the request's `input` (output items turned back into input as above); the
previous response's `instructions` are not carried over, as in OpenAI's API.

Errors the chat path finds name the request's fields: a chat message's path as the input item
(or `instructions`) it came from (`ResponsesPaths`).

Refused (400) rather than ignored: `conversation`, `background` and item references, and fields
this server cannot honour (non-function tools, image or file inputs, `reasoning.effort`,
`truncation: "auto"`, `max_tool_calls`, `top_logprobs`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from pydantic import Field, field_validator

from gateway.errors import GatewayError
from gateway.openai_protocol import _ChatTemplateFields

MAX_METADATA_KEYS = 16


def new_id(prefix: str) -> str:
    """A new item or response id: `prefix`, then 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(_ChatTemplateFields):
    """`POST /v1/responses` (unknown fields accepted, as in the chat API)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # None: OpenAI's default, true
    previous_response_id: str | None = None
    # Refused when set to what this server does not keep or would change the answer (module).
    conversation: Any = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} metadata keys")
        return value

    def check_supported(self) -> None:
        for name, why in (("conversation", "conversations are not supported; chain "
                                           "responses with previous_response_id"),
                          ("max_tool_calls", "not supported"),
                          ("top_logprobs", "not supported on /v1/responses")):
            if getattr(self, name) not in (None, 0):
                raise GatewayError.invalid(name, f"{name}: {why}")
        if self.background:
            raise GatewayError.invalid("background", "background: not supported (a response "
                                       "runs while its request is open)")
        if self.truncation not in (None, "disabled"):
            raise GatewayError.invalid("truncation", "truncation: only 'disabled' (a prompt "
                                       "past the context is an error, not cut)")
        if self.reasoning and self.reasoning.get("effort") is not None:
            raise GatewayError.invalid("reasoning.effort", "reasoning.effort is not supported; "
                                       "chat_template_kwargs switch a model's thinking (e.g. "
                                       "Qwen3's enable_thinking)")

    @property
    def wants_store(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items, each with an id (a string: one user message), as a stored
        response keeps them and `input_items` lists them."""
        if isinstance(self.input, str):
            return [{"type": "message", "id": new_id("msg"), "role": "user",
                     "content": [{"type": "input_text", "text": self.input}]}]
        return [_with_id(item) for item in self.input]

    def chat_body(self, previous: Sequence[dict[str, Any]] = ()
                  ) -> tuple[dict[str, Any], ResponsesPaths]:
        """The equivalent chat completion request's JSON body, and how this request names the
        body's field paths (for the chat path's errors: `GatewayError.renamed`). `previous`:
        the stored conversation `previous_response_id` continues, put after `instructions`
        (this request's own) and before `input`."""
        self.check_supported()
        turns = _Turns()
        if self.instructions:
            turns.append({"role": "system", "content": self.instructions}, "instructions",
                         {"content": ""})
        for item in previous:
            turns.add(item, "previous_response_id")
        if isinstance(self.input, str):
            turns.append({"role": "user", "content": self.input}, "input", {"content": ""})
        else:
            for i, item in enumerate(self.input):
                turns.add(item, f"input.{i}")
        body: dict[str, Any] = {"model": self.model, "messages": turns.messages}
        for ours, chat in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                           ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                           ("chat_template_kwargs", "chat_template_kwargs"),
                           ("chat_template", "chat_template")):
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        if self.tools:
            body["tools"] = [_chat_tool(t, f"tools.{i}") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        # Sampling extensions the chat API takes (seed, stop, top_k, ...) pass through.
        for key, value in (self.model_extra or {}).items():
            if key not in body and key not in _RESPONSES_ONLY:
                body[key] = value
        return body, ResponsesPaths(turns.origins)


# Fields of the Responses API with no chat counterpart that change nothing here.
_RESPONSES_ONLY = frozenset({"include", "user", "safety_identifier", "service_tier",
                             "prompt_cache_key", "prompt_cache_retention", "stream_options"})


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def _with_id(item: Any) -> Any:
    """An input item with an id (its own string id, else a new one); anything else as it is
    (the conversion refuses it)."""
    if not isinstance(item, dict) or isinstance(item.get("id"), str):
        return item
    kind = str(item.get("type", "message" if "role" in item else ""))
    return {**item, "id": new_id(_ID_PREFIXES.get(kind, "item"))}


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError.invalid(param, f"{param} must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise GatewayError.invalid(f"{param}.{j}", f"{param}.{j}: only text parts are "
                                       f"supported (got {kind!r})")
        text = part.get("text")
        if not isinstance(text, str):
            raise GatewayError.invalid(f"{param}.{j}.text", f"{param}.{j}.text must be a string")
        texts.append(text)
    return "".join(texts)


# A chat message's and a tool call's fields named otherwise in the input item they came from
# ("": the item itself).
_OUTPUT_FIELDS = {"content": "output", "tool_call_id": "call_id"}
_CALL_FIELDS = {"id": "call_id", "function": "", "function.name": "name",
                "function.arguments": "arguments"}


class _Turns:
    """Input items → chat messages. A `reasoning` item's text goes with the assistant turn right
    after it (`reasoning_content`; the template decides whether to show it) and is dropped
    before anything else. `origins` maps each message's chat path (`messages.3`, a merged call's
    `messages.3.tool_calls.1`, their fields) to where the request has it (`input.5`,
    `input.5.arguments`, `instructions`): indices differ once `instructions` adds a message or
    several `function_call` items make one turn."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: dict[str, str] = {}
        self._reasoning: str | None = None

    def add(self, item: Any, param: str) -> None:
        if not isinstance(item, dict):
            raise GatewayError.invalid(param, f"{param} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        reasoning, self._reasoning = self._reasoning, None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise GatewayError.invalid(f"{param}.role", f"{param}.role must be user, "
                                           f"system, developer or assistant (got {role!r})")
            self.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content"), f"{param}.content")},
                        param, reasoning=reasoning)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = self.messages[-1] if self.messages else None
            if (reasoning is None and last is not None and last["role"] == "assistant"
                    and last.get("tool_calls")):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                self.append({"role": "assistant", "content": None, "tool_calls": [call]},
                            param, reasoning=reasoning)
            self._name(f"messages.{len(self.messages) - 1}.tool_calls."
                       f"{len(self.messages[-1]['tool_calls']) - 1}", param, _CALL_FIELDS)
        elif kind == "function_call_output":
            self.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text_of(item.get("output"), f"{param}.output")},
                        param, _OUTPUT_FIELDS)
        elif kind == "reasoning":
            parts = item.get("content") or []
            self._reasoning = "".join(
                p["text"] for p in parts if isinstance(p, dict)
                and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str))
        else:
            raise GatewayError.invalid(f"{param}.type", f"{param}: input items of type "
                                       f"{kind!r} are not supported (messages, function_call, "
                                       "function_call_output, reasoning)")

    def append(self, message: dict[str, Any], origin: str, fields: dict[str, str] | None = None,
               *, reasoning: str | None = None) -> None:
        """Add `message`, which the request has at `origin` (its `fields` named as there)."""
        if reasoning and message["role"] == "assistant":
            message["reasoning_content"] = reasoning
        self._name(f"messages.{len(self.messages)}", origin, fields or {})
        self.messages.append(message)

    def _name(self, path: str, origin: str, fields: dict[str, str]) -> None:
        self.origins[path] = origin
        for chat, ours in fields.items():
            self.origins[f"{path}.{chat}"] = f"{origin}.{ours}" if ours else origin


def _chat_tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        got = tool.get("type") if isinstance(tool, dict) else tool
        raise GatewayError.invalid(param, f"{param}: only function tools are supported "
                                   f"(got {got!r})")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none" / "auto" / "required", or something the chat path refuses


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise GatewayError.invalid("text.format", "text.format.type must be text, json_object or "
                               f"json_schema (got {kind!r})")


# Chat request fields as the Responses API names them (for error messages).
_PATHS = ((re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
          (re.compile(r"\bresponse_format\b"), "text.format"),
          (re.compile(r"(?<![\w.])messages(?=[.\[:]|$)"), "input"))  # the list as a whole
# A path into one chat message, as the chat checks write it: `messages.3.tool_calls.1.id`,
# `messages[3].content`.
_MESSAGE_PATH = re.compile(r"(?<![\w.])messages(?:\.(\d+)|\[(\d+)\])((?:\.\w+)*)")


class ResponsesPaths:
    """The chat request's field paths in a text (an error's message or param) as a Responses
    request names them: a chat message's path as the request field it came from (`_Turns`'
    `origins`: `input.5.arguments` for `messages.3.tool_calls.1.function.arguments`), then the
    other fields (`max_tokens` → `max_output_tokens`, ...). Without origins (before or apart
    from converting the input), `messages.N` is `input.N`."""

    def __init__(self, origins: dict[str, str] | None = None) -> None:
        self._origins = origins or {}

    def __call__(self, text: str) -> str:
        text = _MESSAGE_PATH.sub(self._origin, text)
        for pattern, replacement in _PATHS:
            text = pattern.sub(replacement, text)
        return text

    def _origin(self, match: re.Match[str]) -> str:
        parts = ["messages", match[1] or match[2], *match[3].split(".")[1:]]
        for n in range(len(parts), 1, -1):  # the longest path with a known origin
            origin = self._origins.get(".".join(parts[:n]))
            if origin is not None:
                return ".".join([origin, *parts[n:]])
        return ".".join(["input", *parts[1:]])


# -- stored responses -------------------------------------------------------------------------
MAX_ITEMS_PER_PAGE = 100


def response_not_found(response_id: str, *, storing: bool,
                       param: str = "response_id") -> GatewayError:
    """The 404 of an unknown (or evicted, deleted, never stored) response id; `storing`: whether
    this gateway stores responses at all (if not, the message says so)."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    why = "" if storing else (" (this server stores no responses: --responses-store-max-entries "
                              "or --responses-store-max-bytes is 0)")
    return GatewayError(grpc.StatusCode.NOT_FOUND,
                        f"{what} with id '{response_id}' not found.{why}", param=param,
                        error_code=f"{what.lower().replace(' ', '_')}_not_found")


def input_item_page(items: Sequence[dict[str, Any]], query: Mapping[str, str]
                    ) -> dict[str, Any]:
    """One page of a stored response's input items, as OpenAI lists them: `limit` (1-100,
    default 20) items in `order` (`asc`, or `desc`: the default, newest first) after the item
    whose id is `after`."""
    limit_text = query.get("limit", "20")
    limit = int(limit_text) if limit_text.isdigit() else 0
    if not 1 <= limit <= MAX_ITEMS_PER_PAGE:
        raise GatewayError.invalid("limit", f"limit must be an integer from 1 to "
                                            f"{MAX_ITEMS_PER_PAGE}, got {limit_text!r}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise GatewayError.invalid("order", f"order must be 'asc' or 'desc', got {order!r}")
    listed = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in listed]
        if after not in ids:
            raise GatewayError.invalid("after", f"after: no input item with id {after!r} in "
                                                "this response")
        listed = listed[ids.index(after) + 1:]
    page = listed[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > limit}
