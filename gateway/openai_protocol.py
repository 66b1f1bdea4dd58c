"""OpenAI wire format, the requests' side: request models (pydantic v2, unknown fields
accepted), their parsing, and the prompt and message forms they take. The response builders are
gateway/openai_bodies.py.

Request models accept unknown fields because benchmark clients send extras (`ignore_eos`,
`max_completion_tokens`, `stream_options.continuous_usage_stats`). Their numbers and booleans
are strict, as the JSON types say: `true`, `"8"` or `8.0` is not an integer, `"1"` is not a
number and `1` or `"yes"` is not a boolean (a 400 naming the field).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from engine_api.sampling_params import MAX_LOGIT_BIAS_ENTRIES
from gateway.errors import GatewayError
from gateway.structured import structured_from_request

M = TypeVar("M", bound=BaseModel)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


# Fields of OpenAI's API (and vLLM's extras) that change what comes back and that this server
# does not implement, with what a client can do instead.
_UNSUPPORTED_FIELDS = {
    "tools": "tool calling is a chat completions feature",
    "tool_choice": "tool calling is a chat completions feature",
    "functions": "the deprecated functions API; send tools",
    "function_call": "the deprecated functions API; send tool_choice",
    "suffix": "no insertion; send the text before it as the prompt",
    "echo": "chat completions do not echo; /v1/completions does",
    "audio": "text output only",
    "logits_processors": "custom logits processors (server-side code) are not run here",
}


# vLLM's `priority` extra: lower is scheduled sooner. An int32, as the workers' protos carry
# it; strict, so that true, 2.0 or "2" is refused rather than read as a number.
Priority = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]


# vLLM's `truncate_prompt_tokens` extra: keep the prompt's last k tokens (-1: max_model_len; the
# range is the engine's rule, `check_truncation`). Strict, as `Priority`: true, 2.0 or "2" is
# refused rather than read as a number.
TruncatePromptTokens = StrictInt


class _PriorityField(_Open):
    """A request the workers schedule: anything but 0 needs them started with
    --scheduling-policy priority (they refuse it otherwise: a 400 with their message)."""

    priority: Priority = 0


class _SamplingFields(_PriorityField):
    """Fields shared by completions and chat completions (vLLM's extras included)."""

    model: str | None = None
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    user: str | None = None
    logit_bias: dict[str, StrictFloat] | None = None   # JSON keys are strings: {"50256": -100}
    allowed_token_ids: list[StrictInt] | None = None   # vLLM's extra
    prompt_logprobs: StrictInt | None = None           # vLLM's extra: score the prompt, top-n each
    bad_words: list[str] | None = None           # vLLM's extra: words the output never contains
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM's extra: see its type
    # vLLM's extra (RL rollouts read them to avoid re-tokenizing): the prompt's token ids and
    # each choice's output token ids in the response (streamed: each delta's).
    return_token_ids: StrictBool = False
    # vLLM's extra: logprobs name each token "token_id:<id>" instead of its text (for tokens
    # whose text does not round-trip, e.g. partial UTF-8).
    return_tokens_as_token_ids: StrictBool = False
    # vLLM's extra: cached KV is shared only among requests with the same salt (one per tenant).
    cache_salt: str | None = None

    def sampling_options(self, defaults: Mapping[str, float | int] | None = None
                         ) -> dict[str, Any]:
        """Engine `SamplingParams` keyword arguments (max_tokens and logprobs added by callers);
        a field the request leaves unset takes `defaults`' value (the model's generation
        config: `GatewayConfig.sampling_defaults`), else the neutral one."""
        d = defaults or {}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "n": self.n,
            "temperature": d.get("temperature", 1.0) if self.temperature is None
            else self.temperature,
            "top_p": d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            "top_k": d.get("top_k", -1) if self.top_k is None else self.top_k,
            "min_p": d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": d.get("repetition_penalty", 1.0)
            if self.repetition_penalty is None else self.repetition_penalty,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": _token_keys(self.logit_bias or {}, "logit_bias"),
            "allowed_token_ids": self.allowed_token_ids,
            "prompt_logprobs": self.prompt_logprobs,
            "bad_words": list(self.bad_words or []),
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            # response_format, structured_outputs, guided_*: gateway/structured.py
            "structured_outputs": structured_from_request(self.model_extra or {}),
        }

    # Fields of `_UNSUPPORTED_FIELDS` this request type implements.
    _supported: ClassVar[frozenset[str]] = frozenset()

    def check_supported(self) -> None:
        """Refuse (400) what this server would otherwise silently ignore: unknown fields are
        accepted for benchmark clients' extras, but a client asking for tools must not get
        plain text as if they had been applied."""
        extra = self.model_extra or {}
        for name in _UNSUPPORTED_FIELDS.keys() - self._supported:
            value = extra.get(name)
            if value is None or value == [] or value == "" or value == {}:
                continue
            if name == "tool_choice" and value == "none":
                continue
            raise GatewayError.invalid(name, f"{name} is not supported by this server "
                                             f"({_UNSUPPORTED_FIELDS[name]})")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and \
            self.stream_options.continuous_usage_stats


def _token_keys(mapping: dict[str, float], param: str) -> dict[int, float]:
    """A JSON object keyed by token ids ("50256") → keyed by ints; a key that is not a
    non-negative integer is the client's error."""
    if len(mapping) > MAX_LOGIT_BIAS_ENTRIES:  # before the keys are parsed
        raise GatewayError.invalid(param, f"{param} may name at most {MAX_LOGIT_BIAS_ENTRIES} "
                                          f"tokens, got {len(mapping)}")
    out: dict[int, float] = {}
    for key, value in mapping.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise GatewayError.invalid(param, f"{param} keys must be token ids (non-negative "
                                              f"integers as strings), got {key[:20]!r}")
        out[int(key)] = value
    return out


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. `prompt` is checked by `prompt_inputs` for a precise message."""

    prompt: Any = None
    max_tokens: StrictInt | None = 16   # 0 with echo: the prompt alone (scored, with logprobs)
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    add_special_tokens: StrictBool = True  # vLLM's extra: the tokenizer's BOS etc. on a text prompt

    def prompt_scoring(self) -> int | None:
        """Top logprobs to score each prompt token with (None: not scored): `prompt_logprobs`,
        and `logprobs` when the prompt is echoed with logprobs."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if k is not None]
        return max(wanted) if wanted else None


class TextPart(_Open):
    type: str
    text: str | None = None


class ToolCallFunction(_Open):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Open):
    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatMessageIn(_Open):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None             # a tool message: the call it answers
    # An assistant's earlier reasoning, as vLLM (`reasoning`) and SGLang (`reasoning_content`)
    # take it back; the template decides whether to show it (Qwen3's keeps the last turn's).
    reasoning: str | None = None
    reasoning_content: str | None = None


# Template variables the renderer sets itself: `chat_template_kwargs` may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "add_generation_prompt", "tools", "tokenize", "bos_token", "eos_token",
    "unk_token", "pad_token"})
MAX_TEMPLATE_KWARGS = 32


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's `chat_template_kwargs` (e.g. `{"enable_thinking": false}` for Qwen3): extra
    variables for the chat template, at most 32, none of the renderer's own."""
    if value is None:
        return None
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} template variables")
    for key in value:
        if not key.isidentifier():
            raise ValueError(f"{key!r} is not a template variable name")
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise ValueError(f"{key!r} is set by the server, not by chat_template_kwargs")
        if key == "chat_template":
            raise ValueError("a request's own template is the chat_template field, not a "
                             "template variable")
    return value


class _ChatTemplateFields(_Open):
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's (and transformers'): end the prompt with the template's assistant header (a new
    # turn), or (continue_final_message) right after the final message's text, so the model
    # continues that message: a prefilled answer. At most one of the two.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # vLLM's per-request template, in place of the server's: served only with
    # --trust-request-chat-template, and checked then (`check_request_chat_template`).
    chat_template: str | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """`POST /v1/chat/completions`."""

    _supported: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})  # gateway/tools.py

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    # vLLM's extras: the tokenizer's special tokens on the rendered template (the template
    # usually writes BOS itself, hence off), and documents for a RAG template (`documents`).
    add_special_tokens: StrictBool = False
    documents: list[dict[str, str]] | None = None


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's `/tokenize`: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: StrictBool = True  # for a prompt (the chat template has its own)


class DetokenizeRequest(_Open):
    """vLLM's `/detokenize`."""

    model: str | None = None
    tokens: list[StrictInt]


class LoadLoRAAdapterRequest(_Open):
    """vLLM's `POST /v1/load_lora_adapter` (gateway/lora_admin.py): a PEFT adapter directory
    as the workers see it, and the name requests will give it as their `model`."""

    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False  # vLLM's: replace a loaded adapter's weights (refused)


class UnloadLoRAAdapterRequest(_Open):
    """vLLM's `POST /v1/unload_lora_adapter` (its `lora_int_id` is accepted and ignored)."""

    lora_name: StrictStr


class EmbeddingRequest(_PriorityField):
    """`POST /v1/embeddings`. `input` is checked by `prompt_inputs` (the forms of completions'
    `prompt`); `user` is accepted and ignored, as vLLM does."""

    input: Any = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    normalize: StrictBool | None = None  # vLLM's extra: None, the model's (normalized)
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM's extra, as completions'
    cache_salt: str | None = None  # as completions': cached blocks shared within a salt only


class ScoreRequest(_PriorityField):
    """`POST /v1/score`: `text_1` one text (scored against each of `text_2`) or as many as
    `text_2` (scored pair by pair); each side a string, token ids, or a list of either."""

    model: str | None = None
    text_1: Any = None
    text_2: Any = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None


class ClassifyRequest(_PriorityField):
    """`POST /v1/classify` (vLLM's): each of `input` (the forms of embeddings' `input`)
    classified by the model's head."""

    model: str | None = None
    input: Any = None
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None


class RerankRequest(_PriorityField):
    """`POST /v1/rerank`: `documents` ordered by their score against `query`, the best
    `top_n` (all when absent or 0)."""

    model: str | None = None
    query: str | list[int] | None = None
    documents: Any = None
    top_n: StrictInt | None = Field(default=None, ge=0)
    return_documents: StrictBool = True
    truncate_prompt_tokens: TruncatePromptTokens | None = None


def parse_request(model: type[M], body: dict[str, Any]) -> M:
    """Validate a JSON object; the first error becomes a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "missing":
            raise GatewayError.invalid(field, f"{field} is required") from None
        got = first.get("input")
        shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
        raise GatewayError.invalid(field, f"{field}: {first['msg']} (got {shown})") from None


# -- prompt forms ------------------------------------------------------------------------------
PromptInput = str | list[int]

_PROMPT_FORMS = ("a string, a list of token ids, or a list of strings or of lists of token "
                 "ids (a batch)")


def prompt_inputs(prompt: Any, max_prompts: int, param: str = "prompt") -> list[PromptInput]:
    """`prompt` as one or more prompts (strings or token ids), as OpenAI's `prompt` takes them
    (and embeddings' `input`, named `param` in errors): a string, token ids, or a batch of
    either (at most `max_prompts`)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        batch: list[PromptInput] | None = None
        if all(isinstance(p, str) for p in prompt):
            batch = [str(p) for p in prompt]
        elif all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            batch = [list(p) for p in prompt]
        if batch is not None:
            if len(batch) > max_prompts:
                raise GatewayError.invalid(
                    param, f"{param}: at most {max_prompts} prompts per request, got "
                           f"{len(batch)}")
            return batch
    if prompt is None:
        raise GatewayError.invalid(param, f"{param} is required")
    if prompt == []:
        raise GatewayError.invalid(param, f"{param} must not be empty")
    raise GatewayError.invalid(param, f"{param} must be {_PROMPT_FORMS}")


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def chat_messages(messages: Sequence[ChatMessageIn]) -> list[dict[str, Any]]:
    """Messages as `{role, content: str}` for the chat template (text parts joined), with an
    assistant's `tool_calls` (their arguments as objects, as transformers' templates take them)
    and reasoning (as `reasoning_content`, the name templates read, and `reasoning`), and a tool
    message's `tool_call_id` and `name`."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": _message_text(m, i)}
        if m.tool_calls:
            if m.role != "assistant":
                raise GatewayError.invalid(f"messages.{i}.tool_calls",
                                           f"messages.{i}.tool_calls: only assistant messages "
                                           f"make tool calls (role {m.role!r})")
            message["tool_calls"] = [_template_call(c, f"messages.{i}.tool_calls.{j}")
                                     for j, c in enumerate(m.tool_calls)]
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            if m.role != "assistant":
                raise GatewayError.invalid(f"messages.{i}.reasoning_content",
                                           f"messages.{i}: only assistant messages carry "
                                           f"reasoning (role {m.role!r})")
            message["reasoning_content"] = message["reasoning"] = reasoning
        out.append(message)
    return out


def _template_call(call: ToolCallIn, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as err:
        raise GatewayError.invalid(f"{param}.function.arguments",
                                   f"{param}.function.arguments is not JSON: {err}") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def _message_text(m: ChatMessageIn, i: int) -> str:
    """A message's content as one string (text parts joined; none: empty)."""
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise GatewayError.invalid(
                    f"messages.{i}.content.{j}",
                    f"messages.{i}.content.{j}: only {{'type': 'text', 'text': ...}} parts "
                    f"are supported, got type {part.type!r}")
            texts.append(part.text)
        return "\n".join(texts)
    return m.content or ""
