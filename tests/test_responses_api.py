"""OpenAI's Responses API (`POST /v1/responses`, gateway/responses_api.py) through a real gateway
whose fake workers play a scripted output, read by the real `openai` client: `responses.create`
(whole), `responses.stream` (the SDK's own accumulator checks the event sequence and rebuilds the
response), input items reaching the prompt, reasoning and function-call items, structured
output, the 400s for what is not served, and errors naming the input item at fault (not the
chat message it became).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer
from openai import OpenAI

from gateway.responses_api import ResponsesPaths

ANSWER = "Paris is the capital of France."
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
            "{% if m.content %}{{ m.content }}"
            "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
            "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
            "{{ '<|im_start|>assistant\n' }}")
TOOL_SCRIPT = ('<think>The user wants weather.</think>\n\nChecking.\n<tool_call>\n{"name": '
               '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def _ids(text: str) -> list[int]:
    return smollm2_tokenizer().encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def gw() -> Iterator[Harness]:
    with Harness(Script(_ids(ANSWER), num_cached_tokens=2), chat_template=TEMPLATE) as h:
        yield h


@pytest.fixture(scope="module")
def thinking() -> Iterator[Harness]:
    with Harness(Script(_ids(TOOL_SCRIPT)), reasoning_parser="qwen3", tool_call_parser="hermes",
                 chat_template=TEMPLATE) as h:
        yield h


def _client(h: Harness) -> OpenAI:
    return OpenAI(base_url=h.base_url + "/v1", api_key="unused", max_retries=0)


def _prompt(h: Harness) -> str:
    ids = h.prefill[0].prefill_requests[-1].prompt_token_ids
    return smollm2_tokenizer().decode(list(ids), skip_special_tokens=False)


def test_create_returns_the_answer(gw: Harness) -> None:
    resp = _client(gw).responses.create(model=MODEL_NAME, input="The capital of France?",
                                        instructions="Answer briefly.", max_output_tokens=50)
    assert resp.output_text == ANSWER and resp.status == "completed"
    assert [item.type for item in resp.output] == ["message"]
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.usage is not None and resp.usage.output_tokens == len(_ids(ANSWER))
    assert resp.usage.input_tokens == len(gw.prefill[0].prefill_requests[-1].prompt_token_ids)
    assert resp.usage.input_tokens_details.cached_tokens == 2
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert _prompt(gw).startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                  "<|im_start|>user\nThe capital of France?<|im_end|>")


def test_stream_events_rebuild_the_response(gw: Harness) -> None:
    with _client(gw).responses.stream(model=MODEL_NAME, input="The capital of France?",
                                      max_output_tokens=50) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == ANSWER == final.output_text


def test_max_output_tokens_makes_it_incomplete(gw: Harness) -> None:
    resp = _client(gw).responses.create(model=MODEL_NAME, input="Go on", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 3


def test_input_items_reach_the_prompt(gw: Harness) -> None:
    """Messages with text parts, an earlier call and its output; a reasoning item goes with the
    assistant turn after it (this template shows it)."""
    items: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": json.dumps({"city": "Oslo"})},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3C, snow"},
        {"type": "message", "role": "developer", "content": "Be brief."}]
    _client(gw).responses.create(model=MODEL_NAME, input=items, tools=[WEATHER],  # type: ignore[list-item]
                                 tool_choice="none", max_output_tokens=4)
    assert _prompt(gw) == (
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n[Look it up.]<tool_call>get_weather {"city": "Oslo"}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n-3C, snow<|im_end|>\n<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_text_format_becomes_the_constraint(gw: Harness) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _client(gw).responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, text={
        "format": {"type": "json_schema", "name": "s", "schema": schema}})
    so = gw.prefill[0].prefill_requests[-1].sampling.structured_outputs
    assert json.loads(so.json_schema) == schema


def test_reasoning_and_a_function_call(thinking: Harness) -> None:
    client = _client(thinking)
    resp = client.responses.create(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER],  # type: ignore[list-item]
                                   max_output_tokens=100)
    assert [item.type for item in resp.output] == ["reasoning", "message", "function_call"]
    reasoning: Any = resp.output[0]
    assert reasoning.content[0].text == "The user wants weather."
    assert resp.output_text == "Checking."
    call: Any = resp.output[2]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert resp.usage is not None
    think = resp.usage.output_tokens_details.reasoning_tokens
    assert 0 < think < resp.usage.output_tokens  # the tokens up to </think>
    with client.responses.stream(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER],  # type: ignore[list-item]
                                 max_output_tokens=100) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(args) > 1 and "".join(args) == call.arguments  # streamed as written
    assert [e.delta for e in events if e.type == "response.reasoning_text.delta"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"background": True}, "background", "not stored"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0", "only text parts"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "not supported"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "chat_template_kwargs"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "set by the server"),
])
def test_what_is_not_served_is_refused(gw: Harness, body: dict[str, Any], param: str,
                                       words: str) -> None:
    r = httpx.post(f"{gw.base_url}/v1/responses", timeout=10,
                   json={"model": MODEL_NAME, "input": "x", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    with pytest.raises(openai.BadRequestError):
        _client(gw).responses.create(model=MODEL_NAME, input="x", extra_body=body)


def _call(call_id: str, arguments: str = '{"city": "Oslo"}', **fields: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather",
            "arguments": arguments, **fields}


def _output(call_id: str, output: str = "12 C") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


ASK = {"role": "user", "content": "Weather in Oslo and Bergen?"}


@pytest.mark.parametrize(("body", "param"), [
    # `instructions` is chat message 0: each input item is one message further on.
    ({"instructions": "Be brief.", "input": [ASK, _call("c1", "not json")]}, "input.1.arguments"),
    ({"instructions": "Be brief.", "input": [ASK, {"role": "user", "content": "\ud800"}]},
     "input.1.content"),
    # Two function_call items make one assistant turn: the items after it are one message back.
    ({"input": [ASK, _call("c1"), _call("c2"), _output("c1"), _output("c2"),
                _call("c3", "not json")]}, "input.5.arguments"),
    ({"input": [ASK, _call("c1"), _call("c2"), _output("c1"), _output("c2", "\ud800")]},
     "input.4.output"),
    ({"input": [ASK, _call("c1"), _call("c2", name=None)]}, "input.2.name"),  # in the merged turn
    ({"instructions": "Be brief.", "input": [ASK, _call("c1"), {**_call("c2"), "call_id": 7}]},
     "input.2.call_id"),
])
def test_errors_name_the_input_item(gw: Harness, body: dict[str, Any], param: str) -> None:
    """An error the chat path finds names the input item it came from (and its field as the
    item has it), not the chat message the item became."""
    r = httpx.post(f"{gw.base_url}/v1/responses", timeout=10,
                   headers={"content-type": "application/json"},
                   content=json.dumps({"model": MODEL_NAME, **body}))  # \ud800 escaped
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_paths_without_an_item_name_the_input() -> None:
    """The chat path's errors about the messages as a whole (a template's refusal) name
    `input`; prose is left alone."""
    paths = ResponsesPaths()
    assert paths("messages") == "input"
    assert paths("messages: chat template failed") == "input: chat template failed"
    assert paths("messages must contain at least one message") == (
        "messages must contain at least one message")
    assert paths("messages[2].content, max_tokens") == "input.2.content, max_output_tokens"
