"""One request's generation events rendered as OpenAI completion or chat objects: the whole
response, or its stream's chunks (gateway/streaming.py sends them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.chat_tools import chat_finish_reason, chat_outputs
from gateway.generation import Event, Finished, GenerationJob, TokenDelta, usage_totals
from gateway.openai_bodies import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    logprob_rows,
    prompt_logprobs_entries,
    usage_dict,
)
from gateway.reasoning import ChatOutput
from gateway.state import GatewayState
from gateway.tools import ToolCalling
from protos.splitserve.v1 import common_pb2


@dataclass(slots=True)
class _Choice:
    """One choice's output as recorded so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    text_len: int = 0
    finished: Finished | None = None
    started: bool = False  # a delta of it was recorded (a stream echoes in the first)
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CompletionView:
    """Renders one request's events as OpenAI completion or chat objects. `jobs`: one per
    prompt (a completions batch: several); their choices are numbered across them in order,
    as `Orchestrator.generate_batch` numbers the events.

    `echoes`: each job's prompt text, put before its choices' text (completions `echo`), with
    its scored tokens before their logprobs. `hide_output`: the completion's tokens are not
    shown (`max_tokens` 0 with echo: one token is generated to score the prompt).
    `num_prompt_top`: vLLM's `prompt_logprobs` asked for, with this many top entries.
    `tool_calling`: a chat request's tools; unless `tool_choice` is "none", each choice's text
    goes through a `ToolOutput` (content and tool calls). With the gateway's reasoning parser, a
    chat choice's `<think>` text is split off first (`gateway/reasoning.py`); each such choice's
    text goes through a `ChatOutput`."""

    id: str
    object: str
    state: GatewayState
    jobs: list[GenerationJob]
    include_usage: bool
    continuous_usage: bool
    chat: bool
    num_top: int
    num_prompt_top: int | None = None
    echoes: list[str] | None = None
    hide_output: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)
    wants_logprobs: bool = False
    job_of: list[int] = field(default_factory=list)  # choice index -> its job's index
    scored: dict[int, common_pb2.PromptLogprobs] = field(default_factory=dict)  # by job
    tool_calling: ToolCalling | None = None
    outputs: dict[int, ChatOutput] = field(default_factory=dict)  # by choice
    stream: bool = False  # streamed: `auto` tool calls stream their arguments as they come
    # vLLM's `return_token_ids`: prompt and output token ids in the response (and each delta's).
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: "token_id:<id>" tokens

    def __post_init__(self) -> None:
        self.choices = {i: _Choice() for i in range(sum(j.n for j in self.jobs))}
        if self.chat:
            self.outputs = chat_outputs(self.state, self.jobs[0], self.tool_calling,
                                        len(self.choices), incremental=self.stream)
        self.wants_logprobs = self.jobs[0].wants_logprobs  # one sampling for the whole batch
        self.job_of = [j for j, job in enumerate(self.jobs) for _ in range(job.n)]

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                # The model asked for: a LoRA adapter's name when one ran (as vLLM answers).
                "model": self.jobs[0].lora_name or self.state.config.served_model_name,
                "system_fingerprint": None}

    def _text_of(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.state.token_texts(token_id)

    def logprobs(self, lps: list[common_pb2.TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        if self.chat:
            return chat_logprobs(lps, self._text_of, self.num_top)
        return completion_logprobs(logprob_rows(lps), self._text_of, offset)

    def echoed(self, index: int, text: str, lps: list[common_pb2.TokenLogprob]
               ) -> tuple[str, dict[str, Any] | None]:
        """Choice `index`'s text and logprobs with its prompt before them (echo; completions
        only: chat refuses it)."""
        if self.echoes is None:
            return text, self.logprobs(lps, 0)
        j = self.job_of[index]
        text = self.echoes[j] + text
        if not self.wants_logprobs:
            return text, None
        echo = echo_logprobs(self.jobs[j].prompt_token_ids,
                             self.scored.get(j, common_pb2.PromptLogprobs()), self._text_of,
                             self.num_top)
        end = echo["text_offset"][-1] + len(echo["tokens"][-1])
        return text, {key: echo[key] + value for key, value in
                      completion_logprobs(logprob_rows(lps), self._text_of, end).items()}

    def prompt_logprobs(self, index: int) -> list[Any] | None:
        """vLLM's `prompt_logprobs` of choice `index`'s prompt (None: not asked for)."""
        if self.num_prompt_top is None:
            return None
        return prompt_logprobs_entries(
            self.scored.get(self.job_of[index], common_pb2.PromptLogprobs()), self._text_of,
            self.num_prompt_top)

    def record(self, event: Event) -> None:
        choice = self.choices[event.index]
        if isinstance(event, TokenDelta):
            if event.prompt_logprobs is not None:
                self.scored[self.job_of[event.index]] = event.prompt_logprobs
            if not self.hide_output:
                choice.text.append(event.text)
                choice.logprobs.extend(event.logprobs)
                choice.num_tokens += len(event.token_ids)
                choice.token_ids.extend(event.token_ids)
                output = self.outputs.get(event.index)
                if output is not None:
                    output.note(event.text, event.token_ids)
        else:
            choice.finished = event

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once (its n completions share it), completions summed."""
        prompt = cached = 0
        first = 0
        for job in self.jobs:
            mine = [self.choices[i].finished for i in range(first, first + job.n)]
            p, _, c = usage_totals([f for f in mine if f is not None])
            prompt += p or len(job.prompt_token_ids)
            cached += c
            first += job.n
        completion = sum(c.num_tokens for c in self.choices.values())
        usage = usage_dict(prompt, completion, cached)
        if self.chat and self.state.config.reasoning_parser is not None:
            held_back = bool(self.jobs[0].stop)  # a stop string may hold text back
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                out.reasoning_tokens(self.state.tokenizer, held_back)
                for out in self.outputs.values())}
        return usage

    # -- non-stream
    def final(self) -> dict[str, Any]:
        choices = []
        for index, c in sorted(self.choices.items()):
            text, logprobs = self.echoed(index, "".join(c.text), c.logprobs)
            f = c.finished
            item: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                    "finish_reason": self._finish_reason(f),
                                    "stop_reason": f.stop_reason if f else None}
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
                output = self.outputs.get(index)
                if output is not None:
                    output.feed(text)
                    output.finish()
                    item["message"] = output.message()
                    item["finish_reason"] = self._parsed_finish_reason(f, output)
            else:
                item["text"] = text
                if self.num_prompt_top is not None:
                    item["prompt_logprobs"] = self.prompt_logprobs(index)
            if self.return_token_ids:
                item["token_ids"] = list(c.token_ids)
                if not self.chat:  # vLLM: each completion choice's own prompt
                    item["prompt_token_ids"] = self.prompt_ids(index)
            choices.append(item)
        out = self.header(self.object) | {"choices": choices, "usage": self.usage()}
        if self.chat and self.return_token_ids:  # vLLM: the response's, in chat
            out["prompt_token_ids"] = self.prompt_ids(0)
        if self.chat and self.num_prompt_top is not None:  # vLLM: the response's, in chat
            out["prompt_logprobs"] = self.prompt_logprobs(0)
        return out

    def prompt_ids(self, index: int) -> list[int]:
        """The prompt's token ids of choice `index` (its job's)."""
        return list(self.jobs[self.job_of[index]].prompt_token_ids)

    def _finish_reason(self, f: Finished | None) -> str | None:
        if f is None:
            return None
        # The prompt alone was asked for: its one scoring token ended it by length.
        return "length" if self.hide_output and f.finish_reason != "abort" else f.finish_reason

    def _parsed_finish_reason(self, f: Finished | None, output: ChatOutput) -> str | None:
        return chat_finish_reason(self._finish_reason(f), output)

    # -- stream
    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.header(self.object + (".chunk" if self.chat else "")) | {"choices": choices}
        if self.continuous_usage:
            out["usage"] = self.usage()
        return out

    def role_chunk(self, index: int) -> dict[str, Any]:
        out = self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None}])
        if self.return_token_ids:  # vLLM: the prompt's ids come with the first chunk
            out["prompt_token_ids"] = self.prompt_ids(index)
        return out

    def event_chunk(self, event: Event) -> dict[str, Any] | None:
        """The chunk of a recorded event (None: nothing to send yet). A choice's first delta
        carries its echoed prompt, and completion 0's its prompt's `prompt_logprobs`."""
        choice = self.choices[event.index]
        output = self.outputs.get(event.index)
        if output is not None:
            return self._parsed_chunk(event, output)
        extra: dict[str, Any] = {}
        if isinstance(event, TokenDelta):
            first, choice.started = not choice.started, True
            text = "" if self.hide_output else event.text
            lps = [] if self.hide_output else event.logprobs
            if first and self.echoes is not None:
                text, logprobs = self.echoed(event.index, text, lps)
            else:
                logprobs = self.logprobs(lps, choice.text_len)
            choice.text_len += len(text)
            if event.prompt_logprobs is not None and self.num_prompt_top is not None:
                extra["prompt_logprobs"] = self.prompt_logprobs(event.index)
            ids = self._delta_ids(event)
            if first and self.return_token_ids and not self.chat:
                extra["prompt_token_ids"] = self.prompt_ids(event.index)
            if not text and not (lps and self.wants_logprobs) and not extra and not ids:
                return None  # text held back (possible stop string): nothing to send yet
            item: dict[str, Any] = {"index": event.index, "logprobs": logprobs,
                                    "finish_reason": None}
            if self.return_token_ids:
                item["token_ids"] = ids
        else:
            text = ""
            item = {"index": event.index, "logprobs": None,
                    "finish_reason": self._finish_reason(event),
                    "stop_reason": event.stop_reason}
        if self.chat:
            item["delta"] = {"content": text} if isinstance(event, TokenDelta) else {}
            return self.chunk([item]) | extra  # vLLM: the response's, in chat
        item["text"] = text
        return self.chunk([item | extra])

    def _delta_ids(self, event: TokenDelta) -> list[int]:
        """The delta's token ids to send (`return_token_ids`; none otherwise, or hidden)."""
        return list(event.token_ids) if self.return_token_ids and not self.hide_output else []

    def _parsed_chunk(self, event: Event, output: ChatOutput) -> dict[str, Any] | None:
        """A chat chunk of a choice whose text goes through the gateway's parsers: reasoning,
        content and tool-call deltas as they become known; what the end settles comes with the
        finish."""
        if isinstance(event, TokenDelta):
            delta = output.feed(event.text)
            logprobs = self.logprobs(event.logprobs, 0)
            ids = self._delta_ids(event)
            if not delta and not (event.logprobs and self.wants_logprobs) and not ids:
                return None
            item: dict[str, Any] = {"index": event.index, "logprobs": logprobs,
                                    "finish_reason": None}
            if self.return_token_ids:
                item["token_ids"] = ids
        else:
            delta = output.finish()
            item = {"index": event.index, "logprobs": None,
                    "finish_reason": self._parsed_finish_reason(event, output),
                    "stop_reason": event.stop_reason}
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning"] = body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        if delta.calls:
            body["tool_calls"] = delta.calls
        item["delta"] = body
        return self.chunk([item])

    def usage_chunk(self) -> dict[str, Any]:
        return self.header(self.object + (".chunk" if self.chat else "")) | {
            "choices": [], "usage": self.usage()}
