"""`StepOutputs`: what a step's sampled tokens become for each request: a `StepOutput` with
the new text (each request's incremental detokenizer, where a stop string ends the request),
the prompt's logprobs once, and a finished embedding request's vector or class logits."""

from __future__ import annotations

from engine.classifier import Classifier
from engine.outputs import StepOutput
from engine.pooling import embedding
from engine.request import Request, RequestStatus
from engine.scheduler import SampledToken, Scheduler
from engine_api.detokenizer import IncrementalDetokenizer
from engine_api.sampling_params import SamplingParams
from engine_api.tokenizer import Tokenizer


class StepOutputs:
    """One engine's output assembly and its requests' detokenizers (engine thread only)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None, detokenize: bool,
                 classifier: Classifier | None) -> None:
        self._scheduler = scheduler
        # None: outputs carry tokens only (no detokenizer is kept).
        self._tokenizer = tokenizer if detokenize else None
        self._classifier = classifier
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    def track(self, request_id: str, prompt_token_ids: list[int],
              params: SamplingParams) -> None:
        """Detokenize a queued generation's tokens from now on (when the engine does)."""
        if self._tokenizer is not None:
            self._detoks[request_id] = IncrementalDetokenizer(
                self._tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output)

    def drop(self, request_id: str) -> None:
        """Forget an aborted request's detokenizer."""
        self._detoks.pop(request_id, None)

    def output(self, req: Request, toks: list[SampledToken]) -> StepOutput:
        """`req`'s output of a step that emitted `toks`."""
        tokens = [t.token_id for t in toks]
        lp = [t.logprob for t in toks if t.logprob is not None]
        text = ""
        detok = self._detoks.get(req.request_id)
        if detok is not None:
            # One token at a time when a step emitted several (speculative decoding): a stop
            # string may end inside them, and the tokens after it are not part of the output,
            # exactly as plain decoding would never have produced them.
            for i, token in enumerate(tokens):
                res = detok.add_tokens([token])
                text += res.text_delta
                if res.stop_matched is not None:
                    del tokens[i + 1:]
                    del lp[i + 1:]
                    if not req.is_finished:
                        self._scheduler.finish_request(req.request_id,
                                                       RequestStatus.FINISHED_STOPPED)
                        req.stop_reason = res.stop_matched
                    break
        if req.is_finished:
            detok = self._detoks.pop(req.request_id, None)
            if detok is not None and not detok.finished:
                text += detok.finish().text_delta  # flush text held back for stop strings
        prompt_lps = None
        if req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
        pooled = None
        if req.pooling is not None and req.status == RequestStatus.FINISHED_POOLED:
            pooled = embedding(req.pooling)
            if self._classifier is not None:
                pooled = self._classifier.logits(pooled)
        return StepOutput(
            request_id=req.request_id, new_token_ids=tokens, new_logprobs=lp,
            prompt_logprobs=prompt_lps,
            finished=req.is_finished, finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            text_delta=text, stop_reason=req.stop_reason,
            kv_held=req.status == RequestStatus.FINISHED_PREFILL,
            metrics=req.metrics if req.is_finished else None, embedding=pooled)
