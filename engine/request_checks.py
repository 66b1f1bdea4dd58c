"""Every check a request passes before the engine queues it that needs the engine (those
that do not ran when its `RequestOptions` was built): its prompt against the model's
vocabulary and context, its sampling or pooling parameters against the engine's, its options
(LoRA adapter, priority, speculation, remote KV). Reads configuration only, so any thread may
run them (services do, off the engine thread)."""

from __future__ import annotations

from collections.abc import Callable

from engine.classifier import Classifier
from engine.config import (
    MAX_SPECULATIVE_TOKENS,
    SPEC_METHODS,
    EngineConfig,
    ModelConfig,
    PoolerConfig,
)
from engine_api.errors import EngineInputError
from engine_api.pooling_params import PoolingParams, PoolingParamsError
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams


class RequestChecks:
    """One engine's request checks (`LLMEngine.check_request` and the checks it is made of);
    each raises EngineInputError (or SamplingParamsError) naming the field and the limit."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 pooler: PoolerConfig, classifier: Classifier | None, has_tokenizer: bool,
                 lora_slot: Callable[[str | None], int]) -> None:
        self._config = config
        self._model_config = model_config
        self._max_model_len = max_model_len
        self._pooler = pooler
        self._classifier = classifier
        self._has_tokenizer = has_tokenizer
        self._lora_slot = lora_slot

    def check_request(self, prompt_token_ids: list[int], options: RequestOptions) -> None:
        """Every check `LLMEngine.add_request` makes beyond `RequestOptions`' own."""
        self._lora_slot(options.lora_name)
        self.check_priority(options.priority)
        params = options.params
        if isinstance(params, PoolingParams):
            self._check_pooling(prompt_token_ids, params)
            return
        cfg = self._model_config
        if cfg.is_classifier:
            raise EngineInputError(f"this model ({cfg.architecture} with "
                                   f"{len(cfg.class_labels)} labels) classifies and "
                                   "has no LM head: it serves classification, score and "
                                   "pooling requests, not generation")
        speculative_method = options.speculative_method
        if speculative_method is not None and speculative_method not in SPEC_METHODS[1:]:
            raise EngineInputError("speculative_method must be one of "
                                   f"{', '.join(map(repr, SPEC_METHODS[1:]))}, got "
                                   f"{speculative_method!r}")
        params.validate()
        self.validate(prompt_token_ids, params, len(options.output_token_ids or []))
        if params.bad_words and not self._has_tokenizer:
            raise EngineInputError("bad_words needs the model's tokenizer, which this engine "
                                   "does not have")
        num_speculative_tokens = options.num_speculative_tokens
        if num_speculative_tokens is not None and (
                type(num_speculative_tokens) is not int
                or not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise EngineInputError(f"num_speculative_tokens must be an integer in [0, "
                                   f"{MAX_SPECULATIVE_TOKENS}], got {num_speculative_tokens!r}")
        remote_kv = options.remote_kv
        if remote_kv is not None and not 0 < remote_kv.num_tokens <= len(prompt_token_ids):
            # A prefix: the whole prompt (a prefill worker's KV) or its first blocks (a tier).
            raise EngineInputError(
                f"remote KV covers {remote_kv.num_tokens} tokens; it must cover 1 to "
                f"{len(prompt_token_ids)} (the prompt's length)")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 num_output_tokens: int = 0) -> None:
        """The prompt's ids and the parameters' token ids in the vocabulary, and room for one
        more token after the prompt and `num_output_tokens` in the context."""
        self._check_token_ids(prompt_token_ids)
        vocab = self._model_config.vocab_size
        beyond = params.token_ids_beyond(vocab)
        if beyond:
            raise EngineInputError(f"logit_bias / allowed_token_ids / structured_outputs' "
                                   f"reasoning tokens name token ids outside [0, {vocab}): "
                                   f"{beyond[:5]}")
        n = len(prompt_token_ids) + num_output_tokens
        if n >= self._max_model_len:
            raise EngineInputError(
                f"prompt has {n} tokens; max_model_len is {self._max_model_len}, which must "
                "leave room for at least one generated token")

    def check_priority(self, priority: int) -> None:
        """EngineInputError unless `priority` is an int32 this engine's policy takes (any but 0
        needs the "priority" policy, as in vLLM)."""
        if type(priority) is not int or not -(2**31) <= priority < 2**31:
            raise EngineInputError(f"priority must be a 32-bit integer, got {priority!r}")
        if priority and self._config.scheduler.policy != "priority":
            raise EngineInputError(f"priority {priority} asked for, but this engine schedules "
                                   "first come, first served (start it with the scheduling "
                                   "policy 'priority')")

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """`params` with the engine's defaults filled in (`PoolingParams.resolved`);
        EngineInputError for `dimensions` beyond the model's hidden size."""
        if self._classifier is not None and (params.normalize or params.dimensions is not None):
            raise EngineInputError("this model classifies: a pooling request's output is its "
                                   f"{len(self._classifier.labels)} class logit(s), to which "
                                   "normalize and dimensions do not apply")
        try:
            return params.resolved(self._pooler, self._model_config.hidden_size)
        except PoolingParamsError as e:
            raise EngineInputError(str(e)) from None

    def _check_token_ids(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise EngineInputError("prompt must not be empty")
        vocab = self._model_config.vocab_size
        bad = [t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab]
        if bad:
            raise EngineInputError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")

    def _check_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        """`check_request`'s checks of an embedding request."""
        self._check_token_ids(prompt_token_ids)
        if len(prompt_token_ids) > self._max_model_len:
            raise EngineInputError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len "
                                   f"is {self._max_model_len}")
        self.resolve_pooling(params)
