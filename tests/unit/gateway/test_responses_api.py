"""OpenAI's Responses API (`POST /v1/responses`, gateway/responses_api.py) through a real gateway
whose fake workers play a scripted output, read by the real `openai` client: `responses.create`
(whole), `responses.stream` (the SDK's own accumulator checks the event sequence and rebuilds the
response), input items reaching the prompt, reasoning and function-call items, structured
output, the 400s for what is not served, and errors naming the input item at fault (not the
chat message it became). Stored responses: `responses.retrieve` / `delete` /
`input_items.list`, `previous_response_id` chains reaching the prompt, `store: false`, the 404s,
eviction (gateway/response_store.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.config import GatewayConfig, GatewayConfigError
from gateway.response_store import ResponseStore
from gateway.responses_api import ResponsesPaths
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer

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
    ({"background": True}, "background", "not supported"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
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


# -- stored responses ------------------------------------------------------------------------
KEY = "store-test-key"


@pytest.fixture(scope="module")
def small() -> Iterator[Harness]:
    """A store of two responses, behind an API key."""
    with Harness(Script(_ids(ANSWER)), chat_template=TEMPLATE, api_key=KEY,
                 responses_store_max_entries=2) as h:
        yield h


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_stored_response_is_retrieved_as_created(gw: Harness) -> None:
    client = _client(gw)
    resp = client.responses.create(model=MODEL_NAME, input="The capital of France?",
                                   max_output_tokens=50, metadata={"k": "v"})
    assert resp.model_dump()["store"] is True and resp.previous_response_id is None
    assert client.responses.retrieve(resp.id).model_dump() == resp.model_dump()
    base = f"{gw.base_url}/v1/responses/{resp.id}"
    assert _error(httpx.get(f"{base}?stream=true", timeout=10), 400)["param"] == "stream"
    assert _error(httpx.get(f"{base}/input_items?limit=0", timeout=10), 400)["param"] == "limit"


def test_previous_response_id_continues_the_conversation(gw: Harness) -> None:
    """The stored turn (its input, then its output) comes before the new input; the earlier
    `instructions` do not; a chain of chains keeps every turn; `input_items` lists what the
    model was given, pages by `after`."""
    client = _client(gw)
    first = client.responses.create(model=MODEL_NAME, input="The capital of France?",
                                    instructions="Answer briefly.", max_output_tokens=50)
    second = client.responses.create(model=MODEL_NAME, input="And of Italy?",
                                     instructions="Speak French.", max_output_tokens=50,
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.instructions == "Speak French."
    turn = (f"<|im_start|>user\nThe capital of France?<|im_end|>\n"
            f"<|im_start|>assistant\n{ANSWER}<|im_end|>\n")
    assert _prompt(gw) == ("<|im_start|>system\nSpeak French.<|im_end|>\n" + turn +
                           "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")
    client.responses.create(model=MODEL_NAME, input=[{"role": "user", "content": "Spain?"}],
                            max_output_tokens=50, previous_response_id=second.id, store=False)
    assert _prompt(gw) == (turn + "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
                           f"<|im_start|>assistant\n{ANSWER}<|im_end|>\n"
                           "<|im_start|>user\nSpain?<|im_end|>\n<|im_start|>assistant\n")
    items: list[Any] = list(client.responses.input_items.list(second.id, order="asc", limit=1))
    assert [item.type for item in items] == ["message", "message", "message"]
    texts = [item.content[0].text for item in items]
    assert texts == ["The capital of France?", ANSWER, "And of Italy?"]
    assert items[1].id == first.output[0].id and len({item.id for item in items}) == 3
    newest = client.responses.input_items.list(second.id)  # default: desc, 20
    assert [item.id for item in newest.data] == [item.id for item in reversed(items)]


def test_a_chained_function_call_reaches_the_prompt(thinking: Harness) -> None:
    """Reasoning, message and function_call output items become input again, as when a client
    sends them back itself; the call's output follows."""
    client = _client(thinking)
    first = client.responses.create(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER],  # type: ignore[list-item]
                                    max_output_tokens=100)
    call: Any = first.output[2]
    follow_up: Any = [_output(call.call_id, "-3C")]
    client.responses.create(model=MODEL_NAME, previous_response_id=first.id, tools=[WEATHER],  # type: ignore[call-overload]
                            input=follow_up, tool_choice="none", max_output_tokens=4)
    assert _prompt(thinking) == (
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n[The user wants weather.]Checking.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>get_weather {"city": "Oslo"}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n-3C<|im_end|>\n<|im_start|>assistant\n")


def test_store_false_keeps_nothing(gw: Harness) -> None:
    client = _client(gw)
    resp = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, store=False)
    assert resp.model_dump()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="y", previous_response_id=resp.id)


def test_unknown_ids_are_404s(gw: Harness) -> None:
    base = f"{gw.base_url}/v1/responses"
    for r in (httpx.get(f"{base}/resp_nope", timeout=10),
              httpx.delete(f"{base}/resp_nope", timeout=10),
              httpx.get(f"{base}/resp_nope/input_items", timeout=10)):
        error = _error(r, 404)
        assert error["param"] == "response_id" and "resp_nope" in error["message"], error
    error = _error(httpx.post(base, timeout=10, json={
        "model": MODEL_NAME, "input": "x", "previous_response_id": "resp_nope"}), 404)
    assert error["param"] == "previous_response_id" and "resp_nope" in error["message"], error
    assert error["code"] == "previous_response_not_found"
    client = _client(gw)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call("resp_nope")


def test_delete_forgets_it(gw: Harness) -> None:
    client = _client(gw)
    resp = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2)
    r = httpx.delete(f"{gw.base_url}/v1/responses/{resp.id}", timeout=10)
    assert r.status_code == 200 and r.json() == {"id": resp.id, "object": "response",
                                                 "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    kept = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2)
    client.responses.delete(kept.id)  # the SDK's way (it reads no body)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_a_streamed_response_is_stored_once_complete(gw: Harness) -> None:
    client = _client(gw)
    events: list[Any] = list(client.responses.create(
        model=MODEL_NAME, input="The capital of France?", max_output_tokens=50, stream=True))
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.store is True
    stored = client.responses.retrieve(completed.response.id)
    assert stored.model_dump() == completed.response.model_dump()
    assert stored.output_text == ANSWER


def test_a_cut_stream_is_not_stored(gw: Harness) -> None:
    """Not while it runs, nor once the client has left (the generation cancelled)."""
    client = _client(gw)
    state = gw.gateway.state if gw.gateway is not None else None
    assert state is not None
    num_stored = len(state.responses)
    gw.script.endless, gw.script.token_delay_s = True, 0.02
    gw.decode[0].cancelled.clear()
    try:
        with client.responses.create(model=MODEL_NAME, input="Go on", max_output_tokens=200,
                                     stream=True) as stream:
            events: Iterator[Any] = iter(stream)
            created = next(events)
            assert created.response.store is True
            assert next(events).type == "response.in_progress"
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(created.response.id)
        assert gw.decode[0].cancelled.wait(5)
    finally:
        gw.script.endless, gw.script.token_delay_s = False, 0.0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.response.id)
    assert len(state.responses) == num_stored


def test_a_chain_past_the_prompt_limit_is_refused(gw: Harness) -> None:
    """The chat path's prompt limit (256 tokens here) holds for the stored turns too."""
    client = _client(gw)
    long_text = "word " * 150
    first = client.responses.create(model=MODEL_NAME, input=long_text, max_output_tokens=10)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input=long_text, max_output_tokens=10,
                                previous_response_id=first.id)
    assert err.value.code == "context_length_exceeded"


def test_the_store_evicts_the_least_recently_used(small: Harness) -> None:
    client = OpenAI(base_url=small.base_url + "/v1", api_key=KEY, max_retries=0)
    a, b, c = (client.responses.create(model=MODEL_NAME, input=t, max_output_tokens=2)
               for t in "abc")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(a.id)
    client.responses.retrieve(b.id)  # b is now used after c
    d = client.responses.create(model=MODEL_NAME, input="d", max_output_tokens=2,
                                previous_response_id=b.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(c.id)
    assert {client.responses.retrieve(r.id).id for r in (b, d)} == {b.id, d.id}
    metrics = httpx.get(f"{small.base_url}/metrics", timeout=10).text
    assert f'splitserve:responses_stored{{model_name="{MODEL_NAME}"}} 2.0' in metrics
    r = httpx.get(f"{small.base_url}/v1/responses/{b.id}", timeout=10)  # no key
    assert _error(r, 401)["code"] == "invalid_api_key"
    r = httpx.delete(f"{small.base_url}/v1/responses/{b.id}", timeout=10)
    assert r.status_code == 401


def test_storing_off_takes_store_as_false() -> None:
    with Harness(Script(_ids("ok")), responses_store_max_entries=0) as h:
        client = _client(h)
        resp = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2)
        assert resp.model_dump()["store"] is False
        error = _error(httpx.get(f"{h.base_url}/v1/responses/{resp.id}", timeout=10), 404)
        assert "stores no responses" in error["message"]


def _response(n: int, text: str = "x") -> dict[str, Any]:
    return {"id": f"resp_{n}", "output": [{"type": "message", "id": f"msg_{n}",
                                           "content": [{"type": "output_text", "text": text}]}]}


def test_the_store_bounds_bytes_and_keeps_chains_whole() -> None:
    store = ResponseStore(max_entries=10, max_bytes=1000)
    first = store.put(_response(1), [{"role": "user", "content": "hi"}], None)
    assert first is not None and store.num_bytes == first.num_bytes > 0
    second = store.put(_response(2), [{"role": "user", "content": "again"}], first)
    assert second is not None
    assert [i.get("id") or i["content"] for i in second.conversation] == [
        "hi", "msg_1", "again", "msg_2"]
    assert second.conversation[1] is first.conversation[1]  # shared, not copied
    assert store.delete("resp_1") and store.get("resp_2") is second  # the chain stays whole
    assert store.put(_response(3, "y" * 1000), [], None) is None  # alone over the bound
    assert store.get("resp_3") is None and len(store) == 1
    for n in range(4, 20):  # past the bytes before the count
        store.put(_response(n, "z" * 150), [], None)
    assert 0 < store.num_bytes <= 1000 and len(store) < 10
    assert store.get("resp_19") is not None and store.get("resp_2") is None
    assert not ResponseStore(0, 1000).enabled and ResponseStore(0, 1000).put(
        _response(1), [], None) is None


def test_store_bounds_are_checked() -> None:
    with pytest.raises(GatewayConfigError, match="responses_store_max_bytes"):
        GatewayConfig(decode_addresses=("127.0.0.1:1",), colocated=True,
                      responses_store_max_bytes=-1)
