"""The GenAI semantic-convention attributes of a generation request's span: what was asked
(set when the span starts) and what was used and how it ended (set when it ends)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from gateway.generation import Finished, GenerationJob


def request_attributes(job: GenerationJob, served_model_name: str) -> dict[str, AttributeValue]:
    """GenAI semantic-convention request attributes of the request's span."""
    attrs: dict[str, AttributeValue] = {
        "gen_ai.operation.name": job.operation,
        "gen_ai.provider.name": "splitserve",
        "gen_ai.request.model": served_model_name,
        "gen_ai.request.max_tokens": job.sampling.max_tokens,
        "gen_ai.request.temperature": job.sampling.temperature,
        "gen_ai.response.id": job.request_id,
        "gen_ai.response.model": job.lora_name or served_model_name,
        "splitserve.request_id": job.request_id,
    }
    if job.sampling.top_p:  # 0: unset (the model's default)
        attrs["gen_ai.request.top_p"] = job.sampling.top_p
    if job.sampling.HasField("seed"):
        attrs["gen_ai.request.seed"] = job.sampling.seed
    if job.n != 1:
        attrs["gen_ai.request.choice.count"] = job.n
    constraint = output_constraint(job)
    if constraint is not None:
        attrs["splitserve.structured_output"] = constraint
    if job.tool_choice is not None:
        attrs["splitserve.tool_choice"] = job.tool_choice
    if job.priority:
        attrs["splitserve.priority"] = job.priority
    return attrs


def record_usage(span: Span, job: GenerationJob, finished: Sequence[Finished],
                  sent_tokens: int) -> None:
    """GenAI semantic-convention usage/response attributes of a request's span: the output
    tokens it sent (an aborted stream's too, not only its finished completions')."""
    span.set_attribute("gen_ai.usage.input_tokens", len(job.prompt_token_ids))
    span.set_attribute("gen_ai.usage.output_tokens",
                       max(sent_tokens, sum(f.num_output_tokens for f in finished)))
    if finished:
        by_index = sorted(finished, key=lambda f: f.index)
        span.set_attribute("gen_ai.response.finish_reasons", [f.finish_reason for f in by_index])


def output_constraint(job: GenerationJob) -> str | None:
    """The kind of output constraint the job carries (json_schema, json_object, regex, choice,
    grammar), None for free text."""
    if not job.sampling.HasField("structured_outputs"):
        return None
    return job.sampling.structured_outputs.WhichOneof("constraint")
