"""Proto ↔ engine conversions, with validation that names the offending field."""

from __future__ import annotations

from typing import Any

from engine.logprobs import PromptLogprobs, TokenLogprob
from engine.outputs import StepOutput
from engine_api.pooling_params import PoolingParams, PoolingParamsError, PoolingType
from engine_api.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs
from protos.splitserve.v1 import common_pb2

MAX_PROMPT_TOKENS = 1 << 20
MAX_REQUEST_ID_CHARS = 256

FINISH_REASONS: dict[str | None, common_pb2.FinishReason.ValueType] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
}


class InvalidRequest(ValueError):
    """Maps to INVALID_ARGUMENT."""


def sampling_from_proto(sp: common_pb2.SamplingParams) -> SamplingParams:
    """Proto → SamplingParams. Token-level only: stop strings are the gateway's."""
    try:
        return SamplingParams(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p if sp.top_p > 0 else 1.0,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            min_p=sp.min_p,
            seed=sp.seed if sp.HasField("seed") else None,
            max_tokens=sp.max_tokens if sp.max_tokens > 0 else None,
            min_tokens=sp.min_tokens,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            repetition_penalty=sp.repetition_penalty if sp.repetition_penalty > 0 else 1.0,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            logit_bias=dict(sp.logit_bias),
            allowed_token_ids=list(sp.allowed_token_ids) or None,
            structured_outputs=structured_from_proto(sp),
            bad_words=list(sp.bad_words),
        )
    except SamplingParamsError as e:
        raise InvalidRequest(f"sampling.{e}") from e


def structured_from_proto(sp: common_pb2.SamplingParams) -> StructuredOutputs | None:
    """The request's constraint (None: unset); SamplingParamsError when it sets none."""
    if not sp.HasField("structured_outputs"):
        return None
    so = sp.structured_outputs
    kind = so.WhichOneof("constraint")
    # Where the language starts (a thinking model's answer after its reasoning).
    fields: dict[str, Any] = {name: getattr(so, name) if so.HasField(name) else None for name in (
        "reasoning_end_token_id", "reasoning_start_token_id")}
    if kind in ("json_schema", "json_object"):
        fields["any_whitespace"] = not so.disable_any_whitespace
    if kind == "choice":
        return StructuredOutputs(choice=tuple(so.choice.values), **fields)
    if kind is not None:
        name = "json" if kind == "json_schema" else kind
        return StructuredOutputs(**{name: getattr(so, kind)}, **fields)
    raise SamplingParamsError("structured_outputs must set one of json_schema, json_object, "
                              "regex, choice, grammar, structural_tag")


POOLING_TYPES: dict[int, PoolingType] = {common_pb2.POOLING_TYPE_LAST: "LAST",
                                         common_pb2.POOLING_TYPE_MEAN: "MEAN",
                                         common_pb2.POOLING_TYPE_CLS: "CLS"}


def pooling_from_proto(request: common_pb2.EmbedRequest) -> PoolingParams:
    """An `EmbedRequest`'s pooling (proto zeros: the engine's defaults)."""
    kind = request.pooling_type
    if kind != common_pb2.POOLING_TYPE_UNSPECIFIED and kind not in POOLING_TYPES:
        raise InvalidRequest(f"pooling_type {kind} is not a PoolingType")
    try:
        return PoolingParams(
            pooling_type=POOLING_TYPES.get(kind),
            normalize=request.normalize if request.HasField("normalize") else None,
            dimensions=request.dimensions or None)
    except PoolingParamsError as e:
        raise InvalidRequest(str(e)) from e


def check_request_id(request_id: str) -> str:
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
    return request_id


def check_prompt(ids: list[int]) -> list[int]:
    if not ids:
        raise InvalidRequest("prompt_token_ids must not be empty")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise InvalidRequest(f"prompt_token_ids has {len(ids)} tokens; the limit is {MAX_PROMPT_TOKENS}")
    return ids


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def prompt_logprobs_to_proto(scored: PromptLogprobs) -> common_pb2.PromptLogprobs:
    """Column by column (bulk copies into packed fields)."""
    return common_pb2.PromptLogprobs(
        num_top=scored.num_top, token_ids=scored.token_ids, logprobs=scored.logprobs,
        ranks=scored.ranks, top_token_ids=scored.top_ids, top_logprobs=scored.top_logprobs)


def finish_reason(out: StepOutput) -> common_pb2.FinishReason.ValueType:
    return FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED)


# The engine's speculative methods ↔ `splitserve.v1.SpeculativeMethod` (UNSPECIFIED: none named).
SPEC_METHOD_NAMES = {common_pb2.SPECULATIVE_METHOD_NGRAM: "ngram",
                     common_pb2.SPECULATIVE_METHOD_SUFFIX: "suffix",
                     common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL: "draft_model"}
SPEC_METHOD_ENUMS = {name: value for value, name in SPEC_METHOD_NAMES.items()}
