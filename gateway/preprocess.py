"""Shared request preparation for REST and gRPC: tokenize, check limits, build a `GenerationJob`.

Every check raises `GatewayError` (INVALID_ARGUMENT / HTTP 400) with a message that names the
field and says what is allowed.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from engine_api.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    check_truncation,
    truncate_prompt,
)
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.generation import GenerationJob
from gateway.message_text import encode_shielded, shield_special_tokens
from gateway.structured import structured_to_proto
from gateway.tokenization import (
    TokenizerLike,
    check_encodable,
    check_request_chat_template,
    compile_request_chat_template,
)
from protos.splitserve.v1 import common_pb2
from rpc.limits import MAX_PROMPT_LOGPROBS_BYTES, prompt_logprobs_bytes

# Above this many characters, tokenization runs in a thread so the loop keeps streaming.
_INLINE_ENCODE_CHARS = 4096


class Preprocessor:
    """Turns text / token ids / chat messages plus sampling options into a `GenerationJob`."""

    def __init__(self, config: GatewayConfig, tokenizer: TokenizerLike,
                 vocab_size: int | None = None) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size

    # -- prompt ----------------------------------------------------------------------------
    async def encode_text(self, text: str, param: str, add_special_tokens: bool = True,
                          allow_empty: bool = False) -> list[int]:
        """`text`'s token ids; a prompt that encodes to none is refused unless `allow_empty`
        (/tokenize)."""
        check_encodable(text, param)
        if len(text) > self._config.max_body_bytes:
            raise GatewayError.invalid(param, f"{param} is longer than the request size limit")
        if len(text) <= _INLINE_ENCODE_CHARS:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            ids = await asyncio.to_thread(self._tokenizer.encode, text, add_special_tokens)
        if not ids and not allow_empty:  # a worker has nothing to compute (vLLM refuses it too)
            raise GatewayError.invalid(param, f"{param} must not be empty: it encodes to no "
                                              f"tokens")
        return ids

    async def encode_pair(self, text: str, pair: str, param: str, pair_param: str) -> list[int]:
        """A cross-encoder's input: `text` and `pair` tokenized as one (the tokenizer's pair
        template: `Tokenizer.encode_pair`); each side checked as `encode_text` checks a prompt."""
        for value, name in ((text, param), (pair, pair_param)):
            check_encodable(value, name)
            if not value:
                raise GatewayError.invalid(name, f"{name} must not be empty")
        if len(text) + len(pair) > self._config.max_body_bytes:
            raise GatewayError.invalid(param, f"{param} with {pair_param} is longer than the "
                                              "request size limit")
        if len(text) + len(pair) <= _INLINE_ENCODE_CHARS:
            return self._tokenizer.encode_pair(text, pair)
        return await asyncio.to_thread(self._tokenizer.encode_pair, text, pair)

    async def encode_chat(self, messages: list[dict[str, Any]], param: str = "messages",
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None,
                          chat_template: str | None = None, add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          add_special_tokens: bool = False) -> list[int]:
        """The chat template rendered with `messages`, `tools` (transformers' form) and the
        request's `template_kwargs` (its `chat_template_kwargs`, checked by the protocol),
        tokenized. The template: the request's own `chat_template` (checked here, refused unless
        the gateway trusts request templates), else the gateway's `--chat-template`, else the
        model's. `add_generation_prompt`: end with the assistant's header (a new turn);
        `continue_final_message`: end right after the final message's text instead, as
        transformers cuts it, so that the model continues that message."""
        if add_generation_prompt and continue_final_message:
            raise GatewayError.invalid("continue_final_message", "continue_final_message and "
                                       "add_generation_prompt cannot both be true")
        if chat_template is not None:
            check_request_chat_template(chat_template, self._config.trust_request_chat_template)
        if not messages:
            raise GatewayError.invalid(param, f"{param} must contain at least one message")
        for i, m in enumerate(messages):
            check_encodable(m["content"], f"{param}[{i}].content")
        # Special token text inside a message is text (gateway/message_text.py).
        shielded = shield_special_tokens(messages, self._tokenizer.special_token_texts)
        rendered = messages if shielded is None else shielded
        text = await self._render(rendered, tools, template_kwargs, chat_template,
                                  param if chat_template is None else "chat_template",
                                  add_generation_prompt)
        if continue_final_message:
            text = _cut_after_final_message(text, rendered[-1], param)
        # The template usually contains the special tokens (BOS, role markers) itself.
        if shielded is None:
            return await self.encode_text(text, param, add_special_tokens=add_special_tokens)
        if len(text) > self._config.max_body_bytes:
            raise GatewayError.invalid(param, f"{param} is longer than the request size limit")
        return await asyncio.to_thread(encode_shielded, text, self._tokenizer, add_special_tokens)

    async def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any] | None, chat_template: str | None,
                      param: str, add_generation_prompt: bool = True) -> str:
        """The prompt text; a template failure, or nothing rendered, names `param` (the
        request's template when it sent one: its text failed)."""
        render = functools.partial(
            self._tokenizer.apply_chat_template, messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False, chat_template=chat_template or self._config.chat_template,
            tools=tools, **(template_kwargs or {}))
        try:
            if chat_template is None:
                text = render()
            else:
                # The client's code: compiled and rendered off the loop, so that a slow one
                # holds up its own request, not the gateway's other streams.
                text = await asyncio.to_thread(_compiled_then_rendered, chat_template, render)
        except GatewayError:
            raise
        except Exception as err:  # template errors (e.g. role alternation) are the client's
            raise GatewayError.invalid(param, f"{param}: chat template failed: {err}") from None
        if not text:
            raise GatewayError.invalid(param, f"{param}: the chat template rendered an empty "
                                              f"prompt")
        return str(text)

    def check_token_ids(self, ids: Sequence[int], param: str) -> list[int]:
        if not ids:
            raise GatewayError.invalid(param, f"{param} must not be empty")
        limit = self._vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (limit and t >= limit):
                allowed = f"in [0, {limit})" if limit else ">= 0"
                raise GatewayError.invalid(param, f"{param}[{i}] = {t!r}: token ids must be {allowed}")
        return list(ids)

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (vLLM's `truncate_prompt_tokens`: -1 keeps
        max_model_len of them, None all), `keep` checked by the engine's rule. Workers take
        token ids as given, so the gateway cuts right after tokenizing: the length checks,
        prefix hashes (routing) and usage then see only the kept tokens. Cutting a cut prompt
        again changes nothing."""
        try:
            check_truncation(keep, SamplingParamsError)
        except SamplingParamsError as err:
            raise GatewayError.invalid("truncate_prompt_tokens", str(err)) from None
        return truncate_prompt(ids, keep, self._config.max_model_len)

    # -- sampling and limits ---------------------------------------------------------------
    def build_job(self, prompt_token_ids: list[int], params: dict[str, Any], *,
                  request_id: str | None = None, param_names: dict[str, str] | None = None,
                  ) -> GenerationJob:
        """Validate sampling options (engine `SamplingParams` field names) and build the job
        of `prompt_token_ids` as `truncate_prompt_tokens` cuts it (`truncated`).

        `params["max_tokens"] = None` means "the rest of the context" (capped by
        `max_tokens_cap`). `param_names` maps engine field names to the client's names for
        error messages (e.g. max_tokens → max_completion_tokens).
        """
        names = param_names or {}
        sp = _sampling_params(params, names)
        prompt_token_ids = self.truncated(prompt_token_ids, sp.truncate_prompt_tokens)
        beyond = sp.token_ids_beyond(self._vocab_size) if self._vocab_size else []
        if beyond:
            field = ("logit_bias" if beyond[0] in sp.logit_bias else "allowed_token_ids"
                     if beyond[0] in (sp.allowed_token_ids or ()) else "structured_outputs")
            raise GatewayError.invalid(names.get(field, field), (
                f"{names.get(field, field)} names token ids outside the vocabulary "
                f"[0, {self._vocab_size}): {beyond[:5]}"))
        num_prompt = len(prompt_token_ids)
        self.check_prompt_len(num_prompt)
        if sp.prompt_logprobs is not None:
            _check_scoring_size(num_prompt, sp.prompt_logprobs,
                                names.get("prompt_logprobs", "prompt_logprobs"))
        max_tokens = self._resolve_max_tokens(sp.max_tokens, num_prompt, names.get("max_tokens",
                                                                                   "max_tokens"))
        if sp.n > self._config.max_n:
            raise GatewayError.invalid(names.get("n", "n"),
                                       f"n must be at most {self._config.max_n}, got {sp.n}")
        return GenerationJob(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=_to_proto(sp, max_tokens),
            n=sp.n,
            stop=tuple(sp.stop),
            include_stop_str_in_output=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens,
        )

    def check_prompt_len(self, num_prompt: int, param: str = "prompt",
                         generates: bool = True) -> None:
        """A prompt must leave room in the context for one generated token (`generates`; an
        embedding's need not) and stay within `max_prompt_tokens`."""
        limit = min(self._config.max_prompt_tokens, self._config.max_model_len - generates)
        if num_prompt > limit:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{param} has {num_prompt} tokens, but this server allows at most {limit} "
                f"tokens per prompt (max_model_len {self._config.max_model_len})",
                param=param, error_code="context_length_exceeded")

    def _resolve_max_tokens(self, requested: int | None, num_prompt: int, param: str) -> int:
        room = self._config.max_model_len - num_prompt
        if requested is None:  # the model's max_new_tokens when it recommends one
            preferred = int(self._config.defaults.get("max_tokens", self._config.max_tokens_cap))
            return min(room, self._config.max_tokens_cap, preferred)
        if requested > self._config.max_tokens_cap:
            raise GatewayError.invalid(
                param, f"{param} must be at most {self._config.max_tokens_cap}, got {requested}")
        if requested > room:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this model's maximum context length is {self._config.max_model_len} tokens, "
                f"but you requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                f"{requested} for {param}); reduce the prompt or {param}",
                param=param, error_code="context_length_exceeded")
        return requested


def _compiled_then_rendered(template: str, render: Callable[[], Any]) -> Any:
    compile_request_chat_template(template)
    return render()


def _sampling_params(params: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """Engine `SamplingParams` (its validation is the single source of the rules)."""
    try:
        return SamplingParams(**params)
    except SamplingParamsError as err:
        field = str(err).split(" ", 1)[0]
        client_field = names.get(field, field)
        message = str(err)
        if client_field != field:
            message = client_field + message[len(field):]
        raise GatewayError.invalid(client_field, message) from None


def _check_scoring_size(num_prompt: int, num_top: int, param: str) -> None:
    """A scored prompt's logprobs must fit one worker response (rpc/limits.py)."""
    size = prompt_logprobs_bytes(num_prompt, num_top)
    if size > MAX_PROMPT_LOGPROBS_BYTES:
        raise GatewayError.invalid(param, (
            f"{param}: scoring {num_prompt} prompt tokens with {num_top} top logprobs each "
            f"makes up to {size >> 20} MiB of logprobs; the limit is "
            f"{MAX_PROMPT_LOGPROBS_BYTES >> 20} MiB (ask for fewer top logprobs or score a "
            "shorter prompt)"))


def _to_proto(sp: SamplingParams, max_tokens: int) -> common_pb2.SamplingParams:
    proto = common_pb2.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        max_tokens=max_tokens, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
        repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, min_tokens=sp.min_tokens)
    if sp.seed is not None:
        proto.seed = sp.seed % (1 << 64)  # negative seeds wrap into uint64
    if sp.logprobs is not None:
        proto.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        proto.prompt_logprobs = sp.prompt_logprobs
    proto.logit_bias.update(sp.logit_bias)
    if sp.allowed_token_ids is not None:
        proto.allowed_token_ids.extend(sp.allowed_token_ids)
    proto.bad_words.extend(sp.bad_words)  # the workers tokenize them (engine/bad_words.py)
    if sp.structured_outputs is not None:
        structured_to_proto(sp.structured_outputs, proto.structured_outputs)
    return proto


def _cut_after_final_message(text: str, final: dict[str, Any], param: str) -> str:
    """The rendered prompt up to the end of the final message's text (its last occurrence,
    whitespace-stripped, as transformers' `continue_final_message` finds it), so that nothing
    the template closes a turn with follows it."""
    content = final.get("content")
    body = content.strip() if isinstance(content, str) else ""
    if not body:
        raise GatewayError.invalid("continue_final_message", "continue_final_message needs a "
                                   f"final message with text to continue ({param} ends with "
                                   "an empty one)")
    at = text.rfind(body)
    if at < 0:
        raise GatewayError.invalid("continue_final_message", "continue_final_message: the chat "
                                   "template does not render the final message's text as "
                                   "written, so it cannot be continued")
    return text[:at + len(body)]
