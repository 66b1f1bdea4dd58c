"""Per-request sampling parameters, validated at construction (mirrors vLLM's SamplingParams)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# OpenAI's range for a logit bias; vLLM clamps to the same.
LOGIT_BIAS_LIMIT = 100.0
# The highest temperature taken (OpenAI's is 2; vLLM sets none). Past ~100 every token of a
# usual logits row is about equally likely, so a larger value (1e308) is a client's mistake.
MAX_TEMPERATURE = 100.0
# Entries of `logit_bias` one request may carry (a bound on the request's size and on the work
# the sampler does per step for it; OpenAI documents no limit, and 300 is what clients send at
# most in practice).
MAX_LOGIT_BIAS_ENTRIES = 1024
# Ids one `allowed_token_ids` may list: a quarter of a 128k vocabulary (a list beyond that is
# better said as a logit bias against the rest). Bounds a request's size; the sampler keeps the
# list on the device once (engine/sampler.py `shaping_tensors`).
MAX_ALLOWED_TOKEN_IDS = 1 << 15
# Structured outputs (engine/structured.py): a JSON schema, regex or grammar's text at most this
# long (vLLM sets none; a schema this large is already far beyond what clients send), and a
# `choice` list this many strings of at most this many characters.
MAX_STRUCTURED_CHARS = 1 << 17
MAX_CHOICES = 1024
# `bad_words`: how many words a request may ban and how long each may be (each is tokenized
# when the request is queued, and checked against the output's tail every step).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_CHOICE_CHARS = 1024


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names the field and the allowed range."""


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """Constrain the output to a language (vLLM's `StructuredOutputsParams`): exactly one of a
    JSON schema (as JSON text), any JSON object, a regular expression, one of `choice`'s
    strings, or an EBNF grammar (xgrammar's dialect of GBNF, rule `root` first). The output ends
    when the language's string is complete (the model's EOS is then the only token allowed)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # vLLM's structural tag (JSON text; engine/structured.py compiles both of its forms).
    structural_tag: str | None = None
    # JSON (`json`, `json_object`): any whitespace between tokens, as vLLM allows by default;
    # False (vLLM's `disable_any_whitespace`): one fixed layout, so that a model given to
    # newlines cannot spend its tokens on them.
    any_whitespace: bool = True
    # Where the constraint starts, for a thinking model (set by the gateway from its reasoning
    # parser, as vLLM's engine does from its own): the output is free text up to and including
    # `reasoning_end_token_id` (</think>), in the language after it. With
    # `reasoning_start_token_id` as well, the output starts in the language unless its first
    # token is that one (<think>: Qwen3 opens the block itself), which starts the free part.
    # None: the language from the first token.
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def constraint(self) -> StructuredOutputs:
        """The language alone, without where it starts (what compiles, and its cache key)."""
        if self.reasoning_end_token_id is None:
            return self
        return dataclasses.replace(self, reasoning_end_token_id=None,
                                   reasoning_start_token_id=None)

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice", "grammar" or
        "structural_tag"."""
        return self._set()[0]

    def _set(self) -> list[str]:
        return [name for name, value in (("json", self.json), ("json_object", self.json_object),
                                         ("regex", self.regex), ("choice", self.choice),
                                         ("grammar", self.grammar),
                                         ("structural_tag", self.structural_tag))
                if value is not None and value is not False]

    def validate(self) -> None:
        given = self._set()
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {given or 'none'}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            text = getattr(self, name)
            if text is not None and (not isinstance(text, str) or not text
                                     or len(text) > MAX_STRUCTURED_CHARS):
                raise SamplingParamsError(f"structured_outputs.{name} must be a non-empty string "
                                          f"of at most {MAX_STRUCTURED_CHARS} characters")
        for name in ("reasoning_end_token_id", "reasoning_start_token_id"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise SamplingParamsError(f"structured_outputs.{name} must be a token id (an "
                                          "integer >= 0)")
        if self.reasoning_start_token_id is not None and (
                self.reasoning_end_token_id in (None, self.reasoning_start_token_id)):
            raise SamplingParamsError("structured_outputs.reasoning_start_token_id needs a "
                                      "different reasoning_end_token_id")
        for name in ("json_object", "any_whitespace"):
            if getattr(self, name) is not False and getattr(self, name) is not True:
                raise SamplingParamsError(f"structured_outputs.{name} must be a boolean")
        if self.choice is not None and (
                not isinstance(self.choice, tuple) or not 0 < len(self.choice) <= MAX_CHOICES
                or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS
                           for c in self.choice)):
            raise SamplingParamsError(
                f"structured_outputs.choice must be 1 to {MAX_CHOICES} non-empty strings of at "
                f"most {MAX_CHOICE_CHARS} characters")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1              # <= 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-n logprobs per sampled token (0: sampled token only)
    # Logprobs of the prompt's tokens (each given the ones before it) with the top-n at each
    # position (0: the prompt token's only); the engine then computes the whole prompt itself
    # (engine/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the model's logits before sampling (OpenAI `logit_bias`): token id -> bias in
    # [-100, 100]. Logprobs stay those of the model's own distribution.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Only these tokens may be sampled (vLLM's `allowed_token_ids`); None: any.
    allowed_token_ids: list[int] | None = None
    # The output must be a string of this language (engine/structured.py); None: free text.
    structured_outputs: StructuredOutputs | None = None
    # Words the output must not contain (vLLM's `bad_words`): each word's token sequence, as
    # written and after a space, never completed: its last token is banned whenever the output
    # ends with the rest of it (engine/bad_words.py). Needs the engine's tokenizer; not with
    # structured_outputs or allowed_token_ids (they could leave a step no token to sample).
    bad_words: list[str] = field(default_factory=list)
    # Keep only the prompt's last this many tokens (vLLM's `truncate_prompt_tokens`; -1: the
    # engine's max_model_len), applied where the prompt is tokenized (`LLM`, the gateway):
    # an engine's `add_request` takes token ids as given.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value: object, allowed: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name} must be {allowed}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", self.temperature, f"in [0, {MAX_TEMPERATURE:g}]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 or 0 (disabled) or an integer >= 1")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise bad(name, v, "in [-2, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise bad("logit_bias", _short(self.logit_bias),
                      f"a map of at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases")
        for t, v in self.logit_bias.items():
            if not _is_token_id(t) or not _is_number(v) or not abs(v) <= LOGIT_BIAS_LIMIT:
                raise bad("logit_bias", {t: v}, f"token ids >= 0 mapped to biases in "
                          f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS
                or not all(_is_token_id(t) for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", _short(self.allowed_token_ids),
                      f"a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids >= 0")
        if (not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS
                or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS
                           for w in self.bad_words)):
            raise bad("bad_words", _short(self.bad_words),
                      f"a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                      f"{MAX_BAD_WORD_CHARS} characters")
        if self.bad_words and self.allowed_token_ids is not None:
            # An allow-list inside the banned tokens would leave no token to sample.
            raise SamplingParamsError("bad_words cannot be combined with allowed_token_ids")
        check_truncation(self.truncate_prompt_tokens, SamplingParamsError)
        if self.structured_outputs is not None:
            self._validate_structured()

    def _validate_structured(self) -> None:
        if not isinstance(self.structured_outputs, StructuredOutputs):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputs, got "
                                      f"{type(self.structured_outputs).__name__}")
        self.structured_outputs.validate()
        # Both would fight the grammar: a minimum length bans the EOS that ends a complete
        # string, and an allow-list may leave no token the grammar accepts.
        if self.min_tokens > 0:
            raise SamplingParamsError("min_tokens cannot be combined with structured_outputs "
                                      "(the grammar decides where the output ends)")
        if self.allowed_token_ids is not None:
            raise SamplingParamsError("allowed_token_ids cannot be combined with "
                                      "structured_outputs (the grammar decides the allowed tokens)")
        if self.bad_words:
            raise SamplingParamsError("bad_words cannot be combined with structured_outputs "
                                      "(a grammar that allows only banned tokens leaves none)")

    def token_ids_beyond(self, vocab_size: int) -> list[int]:
        """The token ids `logit_bias`, `allowed_token_ids` and `structured_outputs` name that
        the model lacks."""
        so = self.structured_outputs
        marks = () if so is None else (so.reasoning_end_token_id, so.reasoning_start_token_id)
        ids = [*self.logit_bias, *(self.allowed_token_ids or ()),
               *(t for t in marks if t is not None)]
        return sorted({t for t in ids if t >= vocab_size})

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before sampling by a bias or an allow-list."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def check_truncation(k: object, error: type[ValueError]) -> None:
    """`truncate_prompt_tokens` is None, -1 or an integer >= 1; else `error`."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
        raise error(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, "
                    f"got {k!r}")


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `k` tokens (-1: `max_model_len`; None: all of them), as vLLM keeps
    them: the end of a long document, where the question usually is."""
    if k is None:
        return ids
    keep = max_model_len if k == -1 else k
    return ids[-keep:] if len(ids) > keep else ids


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _short(value: object) -> object:
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN
