"""Structured outputs through the whole stack (real SmolLM2 workers, real gateway, the unmodified
`openai` client): OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*` fields,
streamed and not, the gateway's gRPC API; disaggregated (the prefill worker samples the first
token under the grammar, the decode worker rebuilds it from that token) equal to colocated under
greedy sampling; malformed constraints refused with 400s that name the field."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import BadRequestError, OpenAI  # noqa: E402

from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import MODEL_NAME, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "country": {"type": "string", "maxLength": 16},
                       "population_millions": {"type": "integer", "minimum": 0,
                                               "maximum": 50}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Tell me about the capital of France as JSON."}]


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.rest_url, api_key="x", max_retries=0, timeout=120)


def _check_city(text: str) -> dict[str, Any]:
    value = json.loads(text)
    assert set(value) == {"city", "country", "population_millions"}, value
    assert isinstance(value["city"], str) and isinstance(value["country"], str)
    assert type(value["population_millions"]) is int
    return value  # type: ignore[no-any-return]


def _schema_chat(stack: Stack, **kw: Any) -> Any:
    return _client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ASK, temperature=0, max_tokens=80,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}}, **kw)


def test_response_format_json_schema_disagg_equals_colocated(disagg_stack: Stack,
                                                             colocated_stack: Stack) -> None:
    outs = []
    for stack in (disagg_stack, colocated_stack):
        resp = _schema_chat(stack)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        _check_city(choice.message.content or "")
        outs.append(choice.message.content)
        stack.wait_idle()
    assert outs[0] == outs[1]


def test_streamed_json_object(disagg_stack: Stack) -> None:
    stream = _client(disagg_stack).chat.completions.create(
        model=MODEL_NAME, messages=ASK, temperature=0.8, seed=5,  # type: ignore[arg-type]
        max_tokens=120, stream=True, response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict), text
    assert chunks[-1].choices[0].finish_reason == "stop"
    disagg_stack.wait_idle()


@pytest.mark.parametrize(("extra", "check"), [
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{1,12}, [A-Z][a-z]{1,12}"}},
     lambda t: re.fullmatch(r"[A-Z][a-z]{1,12}, [A-Z][a-z]{1,12}", t)),
    ({"guided_choice": ["Paris", "Lyon", "Marseille"]}, lambda t: t in ("Paris", "Lyon", "Marseille")),
    ({"structured_outputs": {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}},
     lambda t: t in ("The answer is yes.", "The answer is no.")),
    ({"guided_json": CITY}, lambda t: _check_city(t) is not None),
], ids=["structured_outputs.regex", "guided_choice", "structured_outputs.grammar", "guided_json"])
def test_completions_with_vllm_fields(disagg_stack: Stack, extra: dict[str, Any],
                                      check: Any) -> None:
    resp = _client(disagg_stack).completions.create(
        model=MODEL_NAME, prompt="The capital of France is", temperature=0.7, seed=1, n=2,
        max_tokens=80, extra_body=extra)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice
        assert check(choice.text), choice.text
    disagg_stack.wait_idle()


def test_constrained_requests_are_counted(disagg_stack: Stack) -> None:
    def count() -> float:
        text = httpx.get(f"{disagg_stack.rest_url.removesuffix('/v1')}/metrics", timeout=10).text
        line = 'splitserve:structured_output_requests_total{constraint="choice",'
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

    before = count()
    _client(disagg_stack).completions.create(model=MODEL_NAME, prompt="Yes or no?", max_tokens=4,
                                             extra_body={"guided_choice": ["yes", "no"]})
    _client(disagg_stack).completions.create(model=MODEL_NAME, prompt="Yes or no?", max_tokens=4)
    assert count() == before + 1
    disagg_stack.wait_idle()


def test_grpc_api_choice(disagg_stack: Stack) -> None:
    tokenizer = disagg_stack.tokenizer
    sampling = common_pb2.SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=common_pb2.StructuredOutputs(
            choice=common_pb2.Choices(values=["blue", "green"])))
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        responses = list(stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=tokenizer.encode("The sky is")),
            sampling=sampling, skip_special_tokens=True), timeout=120))
        text = "".join(r.chunk.text for r in responses if r.WhichOneof("response") == "chunk")
        assert text in ("blue", "green")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=tokenizer.encode("The sky is")),
                sampling=common_pb2.SamplingParams(
                    max_tokens=4, structured_outputs=common_pb2.StructuredOutputs(
                        regex="(unclosed"))), timeout=120))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "regex does not compile" in (err.value.details() or "")
    disagg_stack.wait_idle()


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, None, "structural_tag does not compile"),
    ({"guided_json": {"type": "objectx"}}, None, "json does not compile"),
    ({"guided_grammar": "root ::= undefined_rule"}, None, "grammar does not compile"),
    ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens", "cannot be combined"),
], ids=["schema-missing", "unknown-type", "two-fields", "two-keys", "structural-tag",
        "bad-schema", "bad-grammar", "min-tokens"])
def test_malformed_constraints_are_400s(disagg_stack: Stack, extra: dict[str, Any],
                                        param: str | None, message: str) -> None:
    with pytest.raises(BadRequestError, match=message) as err:
        _client(disagg_stack).chat.completions.create(
            model=MODEL_NAME, messages=ASK, max_tokens=8, extra_body=extra)  # type: ignore[arg-type]
    if param is not None:
        body = err.value.body
        assert isinstance(body, dict) and body.get("param") == param, body
    disagg_stack.wait_idle()
    if param is None:  # the workers refused it (the constraint did not compile): fine afterwards
        assert _schema_chat(disagg_stack).choices[0].finish_reason == "stop"


def test_response_format_structural_tag(disagg_stack: Stack) -> None:
    """vLLM's `response_format` of type structural_tag (xgrammar's form), through the stack."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}
    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<tool>"},
        {"type": "json_schema", "json_schema": schema},
        {"type": "const_string", "value": "</tool>"}]}}
    reply = _client(disagg_stack).chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=48,  # type: ignore[arg-type]
        temperature=0,  # sampled, the integer may run past max_tokens (the grammar allows it)
        extra_body={"response_format": fmt})
    text = reply.choices[0].message.content or ""
    m = re.fullmatch(r"<tool>(.*)</tool>", text, re.S)
    assert m is not None and type(json.loads(m.group(1))["x"]) is int, text
    disagg_stack.wait_idle()


def _grammar_bomb(n: int) -> str:
    """Chained alternatives: compiling them grows fast with n, and each token mask of the
    compiled grammar takes ~n^2 (about 0.2 s at n = 80 on the development CPU, seconds at
    n = 500)."""
    rules = "\n".join(f'r{i} ::= "a" | "b" | r{i + 1}' for i in range(n))
    return "root ::= " + " ".join(f"r{i}" for i in range(n)) + f"\n{rules}\nr{n} ::= \"c\"\n"


def test_a_grammar_bomb_is_refused_and_others_are_served(disagg_stack: Stack) -> None:
    """A grammar whose token masks would stall every step is refused (400 naming the field)
    by the prefill worker's vetting, off the serving loop; a request sent beside it is
    served, and the stack is left idle."""
    import concurrent.futures

    client = _client(disagg_stack)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bomb = pool.submit(client.chat.completions.create, model=MODEL_NAME, max_tokens=4,
                           messages=[{"role": "user", "content": "Say a, b or c."}],
                           extra_body={"structured_outputs": {"grammar": _grammar_bomb(200)}})
        plain = pool.submit(client.completions.create, model=MODEL_NAME, prompt="Hello",
                            max_tokens=4, temperature=0)
        assert plain.result(120).choices[0].text
        with pytest.raises(BadRequestError) as info:
            bomb.result(300)
    message = str(info.value)
    assert "structured_outputs.grammar" in message and "too complex" in message
    # The verdict is kept: the same grammar again is refused at once.
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}],
            extra_body={"structured_outputs": {"grammar": _grammar_bomb(200)}})
    disagg_stack.wait_idle()
