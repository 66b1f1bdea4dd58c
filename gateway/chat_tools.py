"""Chat as both front doors (REST chat completions, gRPC `Gateway.Generate`) apply it: a chat
request's job, each choice's output parsers, and a choice's finish reason.

What a request may ask (`tool_calling_from_request`) and how a choice's output becomes content
and calls (`ToolOutput`) are gateway/tools.py's, how reasoning is split off it
(`ReasoningSplitter`, `ChatOutput`) gateway/reasoning.py's; this module only joins them to a
job, so the two front doors cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.errors import GatewayError
from gateway.generation import GenerationJob
from gateway.reasoning import END as REASONING_END
from gateway.reasoning import START as REASONING_START
from gateway.reasoning import ChatOutput, ReasoningSplitter, prompt_reasoning
from gateway.state import GatewayState
from gateway.tool_output import ToolOutput
from gateway.tool_parsers import HermesOutput
from gateway.tools import ToolCalling, tool_constraint


async def chat_job(state: GatewayState, messages: list[dict[str, Any]], options: dict[str, Any],
                   calling: ToolCalling | None, *, request_id: str, param: str = "messages",
                   param_names: dict[str, str] | None = None,
                   template_kwargs: dict[str, Any] | None = None,
                   chat_template: str | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False,
                   add_special_tokens: bool = False) -> GenerationJob:
    """A chat request's validated job: the chat template (the request's own `chat_template` if
    it sent one) rendered with `messages` (the template's form, `chat_messages`) and the tools,
    tokenized and cut to `options["truncate_prompt_tokens"]`, the sampling `options` as a tool
    choice changes them, and the tool choice recorded on the job (metric, span attribute)."""
    if calling is not None:
        options = options | _tool_options(calling, options, state)
    if state.config.reasoning_parser is not None and state.is_special_text(REASONING_END):
        options = options | {"skip_special_tokens": False}  # the parser reads the tags
    ids = await state.preprocessor.encode_chat(
        messages, param, tools=calling.template_tools() if calling is not None else None,
        template_kwargs=template_kwargs, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, add_special_tokens=add_special_tokens)
    # Cut here already (build_job would too) so that the reasoning gate reads the prompt's end
    # as the model sees it.
    ids = state.preprocessor.truncated(ids, options.get("truncate_prompt_tokens"))
    spec = options.get("structured_outputs")
    if spec is not None and (gate := reasoning_gate(state, ids)) is not None:
        options = options | {"structured_outputs": dataclasses.replace(
            spec, reasoning_end_token_id=gate[0], reasoning_start_token_id=gate[1])}
    job = state.preprocessor.build_job(ids, options, request_id=request_id,
                                       param_names=param_names)
    return dataclasses.replace(job, operation="chat",
                               tool_choice=None if calling is None else calling.mode)


def reasoning_gate(state: GatewayState, prompt_ids: list[int]
                   ) -> tuple[int, int | None] | None:
    """Where a constrained chat output's language starts with the gateway's reasoning parser:
    (the `</think>` token after which it starts, the `<think>` token that may open the output's
    reasoning, if any), as the parser reads the output (`ReasoningSplitter`). None: from the
    first token — no parser, a tag that is not one token in this vocabulary (the engine watches
    tokens, as vLLM's does), or a prompt that closed the block (`enable_thinking: false`)."""
    parser = state.config.reasoning_parser
    if parser is None:
        return None
    start, end = state.token_id_of(REASONING_START), state.token_id_of(REASONING_END)
    if start is None or end is None:
        return None
    where = prompt_reasoning(state.tokenizer, prompt_ids)
    if parser == "deepseek_r1" or where == "open":
        return end, None
    return None if where == "closed" else (end, start)


def _tool_options(calling: ToolCalling, options: dict[str, Any], state: GatewayState
                  ) -> dict[str, Any]:
    """Sampling options a tool choice changes: a named or required choice constrains the output
    (then no other constraint may be asked for); the hermes parser needs its tags in the text
    where a tokenizer has them as special tokens."""
    changes: dict[str, Any] = {}
    constraint = tool_constraint(calling)
    if constraint is not None:
        if options.get("structured_outputs") is not None:
            raise GatewayError.invalid("tool_choice", f"tool_choice {calling.mode!r} constrains "
                                       "the output to tool calls; it cannot be combined with "
                                       "response_format or structured outputs")
        changes["structured_outputs"] = constraint
    if calling.parser == "hermes" and state.is_special_text(HermesOutput.START):
        changes["skip_special_tokens"] = False
    return changes


def chat_outputs(state: GatewayState, job: GenerationJob, calling: ToolCalling | None,
                 num_choices: int, *, incremental: bool) -> dict[int, ChatOutput]:
    """Each choice's parsers of a chat request's output, by choice index: the gateway's reasoning
    parser splits off the `<think>` text (read from where `job`'s prompt left off), then tools
    with a tool choice other than none parse the rest (`incremental`: `auto` calls' arguments as
    the model writes them, for streams). Empty when neither applies: the text is all content."""
    tools = calling if calling is not None and calling.mode != "none" else None
    # A constrained output (structured outputs, a named or required tool choice) reasons first
    # where `reasoning_gate` let it (the language starts after </think>); otherwise it is in
    # the language from its first token, and nothing of it is reasoning, even where the prompt
    # left a <think> open.
    so = job.sampling.structured_outputs
    held = job.sampling.HasField("structured_outputs") and not so.HasField("reasoning_end_token_id")
    parser = None if held else state.config.reasoning_parser
    if tools is None and parser is None:
        return {}
    opens = parser is not None and prompt_reasoning(state.tokenizer,
                                                    job.prompt_token_ids) == "open"
    return {i: ChatOutput(None if parser is None else ReasoningSplitter(parser, opens),
                          None if tools is None else tools.output(incremental=incremental))
            for i in range(num_choices)}


def chat_finish_reason(reason: str | None, output: ChatOutput) -> str | None:
    """A choice's finish reason once its output went through `output` (see
    `tool_finish_reason`)."""
    return reason if output.tools is None else tool_finish_reason(reason, output.tools)


def tool_finish_reason(reason: str | None, tools: ToolOutput) -> str | None:
    """A choice's finish reason once its output went through `tools`: a completion that stopped
    in tool calls ends with "tool_calls" (auto, required; a named call stops, as in OpenAI)."""
    return (tools.finish_reason or reason) if reason == "stop" else reason
