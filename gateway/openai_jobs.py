"""Generation jobs from OpenAI completion and chat requests: checked, tokenized and built
(all of a request's before any runs), for the completions, chat completions and Responses
routes."""

from __future__ import annotations

import uuid
from typing import Any

from gateway.chat_tools import chat_job
from gateway.errors import GatewayError
from gateway.generation import GenerationJob
from gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptInput,
    chat_messages,
    prompt_inputs,
)
from gateway.state import GatewayState
from gateway.tools import ToolCalling, tool_calling_from_request


async def completion_jobs(req: CompletionRequest, state: GatewayState
                          ) -> tuple[str, list[GenerationJob], list[str] | None]:
    """(the response's id, one job per prompt of the request: a batch, several, the prompts'
    texts when they are echoed), all validated before any runs. A batch's jobs are
    `<id>-<i>`."""
    req.check_supported()
    if req.best_of is not None and req.best_of != req.n:
        raise GatewayError.invalid("best_of", "best_of is not supported (it must equal n)")
    max_tokens = req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise GatewayError.invalid("max_tokens", "max_tokens must be at least 1 (0 only "
                                                     "with echo=true: the prompt alone)")
        max_tokens = 1  # the prompt is scored with the first token, which is not shown
    if req.stream and req.echo and req.logprobs is not None and req.n > 1:
        # Completion 0 scores the prompt; the others' first chunks could come before it.
        raise GatewayError.invalid("n", "a stream that echoes the prompt with logprobs takes "
                                        "n = 1 (send the request once per completion, or "
                                        "without stream)")
    prompts = prompt_inputs(req.prompt, state.config.max_prompts_per_request)
    pre = state.preprocessor
    options = req.sampling_options(state.config.defaults) | {
        "max_tokens": max_tokens, "logprobs": req.logprobs,
                                        "prompt_logprobs": req.prompt_scoring()}
    request_id = f"cmpl-{uuid.uuid4().hex}"
    jobs: list[GenerationJob] = []
    echoes: list[str] | None = [] if req.echo else None
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = (await pre.encode_text(prompt, param, req.add_special_tokens)
               if isinstance(prompt, str) else pre.check_token_ids(prompt, param))
        job = pre.build_job(ids, options, request_id=request_id if len(prompts) == 1
                            else f"{request_id}-{i}")
        jobs.append(job)
        if echoes is not None:
            echoes.append(_echo_text(prompt, len(ids), job, state))
    return request_id, jobs, echoes


def _echo_text(prompt: PromptInput, num_sent: int, job: GenerationJob,
               state: GatewayState) -> str:
    """The prompt an echo shows: as sent, or the text of the tokens the model saw when they
    are token ids or `truncate_prompt_tokens` cut them (the echoed logprobs score those)."""
    if isinstance(prompt, str) and len(job.prompt_token_ids) == num_sent:
        return prompt
    return state.tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False)


async def chat_completion_job(req: ChatCompletionRequest, state: GatewayState
                              ) -> tuple[GenerationJob, ToolCalling | None]:
    """A chat request's job (validated, its messages rendered and tokenized) and its tools."""
    req.check_supported()
    if req.top_logprobs is not None and not req.logprobs:
        raise GatewayError.invalid("top_logprobs", "top_logprobs requires logprobs=true")
    max_tokens, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    calling = tool_calling_from_request(req.model_extra or {}, state.config.tool_call_parser)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    options = req.sampling_options(state.config.defaults) | {"max_tokens": max_tokens,
                                                             "logprobs": logprobs}
    job = await chat_job(state, chat_messages(req.messages), options, calling,
                         request_id=f"chatcmpl-{uuid.uuid4().hex}",
                         param_names={"max_tokens": param, "logprobs": "top_logprobs"},
                         template_kwargs=_with_documents(req),
                         chat_template=req.chat_template,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message,
                         add_special_tokens=req.add_special_tokens)
    return job, calling


def _with_documents(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template's variables: `chat_template_kwargs`, and vLLM's `documents` (a RAG
    template's, as transformers passes them) unless the kwargs set their own."""
    if req.documents is None:
        return req.chat_template_kwargs
    return {"documents": req.documents, **(req.chat_template_kwargs or {})}
