"""vLLM's `use_beam_search` for `/v1/completions` and `/v1/chat/completions`: `n` beams, the
request's `max_tokens`, `ignore_eos` and `length_penalty` (engine_api/beam_search.py's algorithm).

Each step runs every live beam as a one-token request with its top `2 * n` logprobs, all of
them as one batch through the orchestrator: routed by prefix like any request, so the workers'
prefix caches hold each beam's earlier tokens and a step computes little more than its last
block. The response holds the `n` best sequences, best first, not streamed (as vLLM answers).

Fields that beam search would otherwise ignore are refused (400) rather than dropped: a stream,
stop strings and tokens, logprobs, penalties, biases, constraints, tools, `min_tokens`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from engine_api.beam_search import BeamSearch, BeamSearchParams, BeamSearchParamsError, BeamSequence
from gateway.errors import GatewayError
from gateway.generation import GenerationJob, TokenDelta
from gateway.openai_protocol import _SamplingFields
from gateway.state import GatewayState
from gateway.structured import structured_from_request
from protos.splitserve.v1 import common_pb2


def beam_params(extra: dict[str, Any], fields: dict[str, object], n: int,
                max_tokens: int, ignore_eos: bool, temperature: float | None
                ) -> BeamSearchParams | None:
    """The request's beam search (None: `use_beam_search` not asked for). `fields`: the
    request's fields beam search does not apply, by name, each set (refused) or not (None,
    False, empty)."""
    use, penalty = extra.get("use_beam_search", False), extra.get("length_penalty")
    if not isinstance(use, bool):
        raise GatewayError.invalid("use_beam_search", "use_beam_search must be true or false")
    if not use:
        if penalty is not None and penalty != 1.0:
            raise GatewayError.invalid("length_penalty", "length_penalty applies to beam search "
                                                         "only (use_beam_search: true)")
        return None
    for name, value in fields.items():
        if value not in (None, False, 0, "", [], {}, ()):
            raise GatewayError.invalid(name, f"{name} does not apply to beam search "
                                             "(use_beam_search)")
    try:
        return BeamSearchParams(beam_width=n, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                temperature=0.0 if temperature is None else temperature,
                                length_penalty=1.0 if penalty is None else penalty)
    except BeamSearchParamsError as err:
        name = str(err).split(" ", 1)[0]
        raise GatewayError.invalid("n" if name == "beam_width" else name, str(err)) from None


def ignored_fields(req: _SamplingFields, **more: object) -> dict[str, object]:
    """A request's fields beam search does not apply, by name (`beam_params`' `fields`), with
    the front door's own (`more`: completions' echo and logprobs, chat's tools...)."""
    extra = req.model_extra or {}
    return {"stream": req.stream, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
            "min_tokens": req.min_tokens, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": None if req.repetition_penalty in (None, 1.0)
            else req.repetition_penalty,
            "logit_bias": req.logit_bias, "allowed_token_ids": req.allowed_token_ids,
            "bad_words": req.bad_words, "prompt_logprobs": req.prompt_logprobs is not None,
            "structured_outputs": structured_from_request(extra) is not None, **more}


async def run_beam_search(state: GatewayState, job: GenerationJob, params: BeamSearchParams
                          ) -> list[BeamSequence]:
    """`job`'s prompt searched: its best `params.beam_width` sequences, best first, their text
    decoded as `job` asks (`skip_special_tokens`)."""
    try:
        search = BeamSearch(job.prompt_token_ids, params, state.tokenizer.eos_token_ids,
                            state.config.max_model_len)
    except BeamSearchParamsError as err:
        raise GatewayError.invalid("max_tokens", str(err)) from None
    params = search.params
    sampling = common_pb2.SamplingParams(temperature=params.temperature, max_tokens=1,
                                         ignore_eos=True, logprobs=params.num_candidates)
    while not search.done:
        steps = [dataclasses.replace(job, request_id=f"{job.request_id}-{search.steps}-{i}",
                                     prompt_token_ids=tuple(beam.tokens), sampling=sampling,
                                     n=1, stop=(), block_hashes={})
                 for i, beam in enumerate(search.beams)]
        candidates: list[list[tuple[int, float]]] = [[] for _ in steps]
        async for event in state.orchestrator.generate_batch(steps):
            if isinstance(event, TokenDelta) and event.logprobs:
                candidates[event.index] = [(t.token_id, t.logprob)
                                           for t in event.logprobs[0].top]
        if not all(candidates):
            raise GatewayError.invalid(None, "a beam search step came back without logprobs")
        search.expand(candidates)
    best = search.results()
    for seq in best:
        seq.text = state.tokenizer.decode(seq.output_token_ids,
                                          skip_special_tokens=job.skip_special_tokens)
    return best


def beam_body(request_id: str, chat: bool, model: str, results: list[list[BeamSequence]],
              token_ids: bool = False) -> dict[str, Any]:
    """The non-streamed completions / chat completions response: each job's sequences as
    consecutive choices, best first (`token_ids`: vLLM's `return_token_ids`)."""
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = 0
    for sequences in results:
        prompt_tokens += sequences[0].num_prompt_tokens if sequences else 0
        for seq in sequences:
            completion_tokens += len(seq.output_token_ids)
            item: dict[str, Any] = {"index": len(choices), "logprobs": None,
                                    "finish_reason": seq.finish_reason, "stop_reason": None}
            if chat:
                item["message"] = {"role": "assistant", "content": seq.text}
            else:
                item["text"] = seq.text
            if token_ids:
                item["token_ids"] = seq.output_token_ids
                if not chat:
                    item["prompt_token_ids"] = seq.tokens[:seq.num_prompt_tokens]
            choices.append(item)
    extra: dict[str, Any] = {}
    if chat and token_ids and results and results[0]:
        first = results[0][0]
        extra["prompt_token_ids"] = first.tokens[:first.num_prompt_tokens]
    return extra | {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
