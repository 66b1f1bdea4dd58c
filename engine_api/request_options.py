"""What a request asks of the engine besides its prompt: `RequestOptions`, one record built
where the request enters (the workers' protobuf conversion, `LLM`, `LLMEngine.add_request`)
and carried whole to the engine's queue. Torch-free: the services build it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine_api.errors import EngineInputError
from engine_api.hashing import cache_salt_problem
from engine_api.pooling_params import PoolingParams
from engine_api.sampling_params import SamplingParams

# A request's speculation class (the gateway's label, e.g. "repetitive"): a short key the
# engine's acceptance statistics are kept by.
MAX_SPEC_CLASS_CHARS = 32
_SPEC_CLASS = re.compile(r"[a-z0-9_]*")


@dataclass(slots=True)
class RemoteKv:
    """The KV of the prompt's first `num_tokens` tokens comes from elsewhere: all of them from
    a prefill worker (decode role), or a prefix of full blocks from the CPU/Redis tiers (prefill
    role, worker/tier_cache.py); the engine computes the rest.

    `handle` is opaque to the engine (the service's loader reads it); the engine only needs to
    know how many prompt tokens the KV covers. `cached`: the KV comes from a cache (the tiers),
    so a successful load counts its tokens as cached ones (`Request.num_cached_tokens`), as
    prefix-cache hits are; KV transferred from a prefill worker is not.

    `first_token` > 0 (a multiple of the block size): the KV covers only tokens
    [first_token, num_tokens) and the engine computes the ones before it (less its own prefix
    cache's) while that KV loads, instead of waiting for it (engine/scheduler.py).
    """

    num_tokens: int
    handle: object = None
    cached: bool = False
    first_token: int = 0


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """A request's parameters and options, validated when built: the rules that need no engine
    raise EngineInputError here (a cache salt's form; an embedding request with output tokens
    or remote KV; prompt logprobs with remote KV), so that no layer checks them again; the
    engine checks the rest against its configuration (`LLMEngine.check_request`).

    `params`: a generation (`SamplingParams`) or an embedding request (`PoolingParams`).
    `output_token_ids`: tokens already generated (a resumed request). `remote_kv`: where its
    prompt's KV comes from when not computed here. `num_speculative_tokens` caps its drafts
    per step (0: none; None: the engine's); `speculative_method` ("ngram" / "suffix" /
    "draft_model") picks the engine's proposer (None, or one the engine lacks: its configured
    one); `speculative_class` is the request's class as the gateway saw it (the engine measures
    acceptance per method and class; at most MAX_SPEC_CLASS_CHARS of [a-z0-9_]);
    `speculative_fixed`: its drafts stay at its cap every step (the step budget does not
    lower them: static speculation).
    `lora_name`: the adapter to run it with (None: the base model). `priority`: lower is
    scheduled sooner (anything but 0 needs the "priority" policy). `cache_salt` (vLLM's): its
    KV is hashed under a root of its own, so only requests with the same salt share it.
    `decode_here`: run it to its end even on a prefill-role engine, which otherwise hands every
    request off after its first token (the Decode service of a prefill worker sets it: with no
    decode worker left, the prefill workers decode; elsewhere it changes nothing).
    """

    params: SamplingParams | PoolingParams
    output_token_ids: list[int] | None = None
    remote_kv: RemoteKv | None = None
    num_speculative_tokens: int | None = None
    speculative_method: str | None = None
    speculative_class: str = ""
    speculative_fixed: bool = False
    lora_name: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    decode_here: bool = False

    def __post_init__(self) -> None:
        problem = cache_salt_problem(self.cache_salt)
        if problem is not None:
            raise EngineInputError(problem)
        if len(self.speculative_class) > MAX_SPEC_CLASS_CHARS or not _SPEC_CLASS.fullmatch(
                self.speculative_class):
            raise EngineInputError(f"speculative_class must be at most {MAX_SPEC_CLASS_CHARS} "
                                   f"characters of [a-z0-9_], got {self.speculative_class[:40]!r}")
        if isinstance(self.params, PoolingParams):
            if self.output_token_ids or self.remote_kv is not None:
                raise EngineInputError("an embedding request computes its prompt here and "
                                       "generates nothing: it takes no output tokens and no "
                                       "remote KV")
        elif self.remote_kv is not None and self.params.prompt_logprobs is not None:
            raise EngineInputError("prompt_logprobs needs the prompt computed by this engine; "
                                   "it cannot come with remote KV")
