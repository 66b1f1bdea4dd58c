"""A request's own chat template (vLLM's `chat_template` field, `--trust-request-chat-template`)
through a real gateway whose fake workers play a scripted output: refused on a gateway without
the flag (REST chat, /tokenize, Responses, gRPC); with it, the prompt the prefill worker gets is
the request's template rendered (the real `openai` client, /tokenize, the Responses API and gRPC
agreeing), the compiled template reused by the next request sending it, and a sandbox escape, a
syntax error or an oversized template a 400 (gRPC INVALID_ARGUMENT). The flag reaches the
gateway from `splitserve up`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from engine_api.chat_template import compile_template
from gateway.tokenization import MAX_REQUEST_CHAT_TEMPLATE_BYTES
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer

TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
ASK = [{"role": "user", "content": "The capital of France?"}]
RENDERED = "[USER] The capital of France?\n[ASSISTANT] "


def _ids(text: str) -> list[int]:
    return smollm2_tokenizer().encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def trusted() -> Iterator[Harness]:
    with Harness(Script(_ids("Paris.")), trust_request_chat_template=True) as h:
        yield h


@pytest.fixture(scope="module")
def untrusted() -> Iterator[Harness]:
    with Harness(Script(_ids("Paris."))) as h:
        yield h


def _client(h: Harness) -> OpenAI:
    return OpenAI(base_url=h.base_url + "/v1", api_key="unused", max_retries=0)


def _prompt_ids(h: Harness) -> list[int]:
    return list(h.prefill[0].prefill_requests[-1].prompt_token_ids)


def _post(h: Harness, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{h.base_url}{path}", timeout=10, json={"model": MODEL_NAME, **body})


def _grpc(h: Harness, template: str) -> list[gateway_pb2.GenerateResponse]:
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in ASK])
    with grpc.insecure_channel(h.grpc_target) as channel:
        return list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            chat=chat, chat_template=template,
            sampling=common_pb2.SamplingParams(max_tokens=10)), timeout=20))


def _refusal(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["param"] == "chat_template", error
    return error


def test_refused_without_the_flag(untrusted: Harness) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(untrusted).chat.completions.create(
            model=MODEL_NAME, messages=ASK, extra_body={"chat_template": TEMPLATE})  # type: ignore[arg-type]
    assert "--trust-request-chat-template" in str(caught.value)
    for path, body in (("/v1/chat/completions", {"messages": ASK}),
                       ("/tokenize", {"messages": ASK}), ("/v1/responses", {"input": "x"})):
        error = _refusal(_post(untrusted, path, {**body, "chat_template": TEMPLATE}))
        assert "--trust-request-chat-template" in error["message"]
    with pytest.raises(grpc.RpcError) as rpc:
        _grpc(untrusted, TEMPLATE)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat_template" in (rpc.value.details() or "")
    assert not untrusted.prefill[0].prefill_requests  # nothing reached a worker


def test_the_request_template_renders_the_prompt(trusted: Harness) -> None:
    """Chat (the openai client), /tokenize, Responses and gRPC all render the request's template;
    without one, the model's; the second request with the same text does not compile it again."""
    tok = smollm2_tokenizer()
    client = _client(trusted)
    template = TEMPLATE + "{# this test's own text #}"
    compiled_before = compile_template.cache_info().misses
    reply = client.chat.completions.create(model=MODEL_NAME, messages=ASK,  # type: ignore[arg-type]
                                           extra_body={"chat_template": template})
    assert reply.choices[0].message.content == "Paris."
    ids = _prompt_ids(trusted)
    assert tok.decode(ids, skip_special_tokens=False) == RENDERED
    tokenized = _post(trusted, "/tokenize", {"messages": ASK, "chat_template": template})
    assert tokenized.json()["tokens"] == ids
    client.responses.create(model=MODEL_NAME, input=ASK[0]["content"],
                            extra_body={"chat_template": template})
    assert _prompt_ids(trusted) == ids
    assert compile_template.cache_info().misses == compiled_before + 1
    assert _grpc(trusted, template)[-1].complete.usage.prompt_tokens == len(ids)
    assert _prompt_ids(trusted) == ids
    client.chat.completions.create(model=MODEL_NAME, messages=ASK)  # type: ignore[arg-type]
    assert "<|im_start|>user" in tok.decode(_prompt_ids(trusted), skip_special_tokens=False)


@pytest.mark.parametrize(("template", "words"), [
    ("{{ ''.__class__.__mro__ }}", "unsafe"),                  # the sandbox: no Python internals
    ("{{ raise_exception.__globals__['os'] }}", "unsafe"),
    ("{{ ''.__class__ }}", "empty prompt"),                    # renders nothing, reaches nothing
    ("{% for m in messages %}{{ m.content }}", "syntax error"),
    ("{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}", "does not compile"),
    ("{{ raise_exception('no system prompt') }}", "no system prompt"),
    ("x" * (MAX_REQUEST_CHAT_TEMPLATE_BYTES + 1), f"limit is {MAX_REQUEST_CHAT_TEMPLATE_BYTES}"),
    ("", "empty"),
])
def test_bad_templates_are_400s(trusted: Harness, template: str, words: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        error = _refusal(_post(trusted, path, {"messages": ASK, "chat_template": template}))
        assert words in error["message"], error
    with pytest.raises(grpc.RpcError) as rpc:
        _grpc(trusted, template)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (rpc.value.details() or "")


def test_where_a_request_template_does_not_belong(trusted: Harness) -> None:
    error = _refusal(_post(trusted, "/tokenize", {"prompt": "x", "chat_template": TEMPLATE}))
    assert "messages" in error["message"]
    r = _post(trusted, "/v1/chat/completions", {
        "messages": ASK, "chat_template_kwargs": {"chat_template": TEMPLATE}})
    assert r.status_code == 400 and "chat_template field" in r.json()["error"]["message"], r.text
    with grpc.insecure_channel(trusted.grpc_target) as channel, pytest.raises(grpc.RpcError) as rpc:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateRequest(text="x", chat_template=TEMPLATE), timeout=20))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat input" in (rpc.value.details() or "")


def test_up_passes_the_gateway_flags() -> None:
    from gateway.server import build_parser as gateway_parser
    from gateway.server import config_from_args
    from splitserve.up import build_parser, service_argv

    for argv, trust in (([], False), (["--trust-request-chat-template"], True)):
        args, engine_args = build_parser().parse_known_args(argv)
        gw_argv = service_argv(args, engine_args)["gateway"]
        config = config_from_args(gateway_parser().parse_args(gw_argv[2:]))
        assert config.trust_request_chat_template is trust
    # The Responses API's store bounds go the same way (absent: the gateway's defaults).
    args, engine_args = build_parser().parse_known_args(
        ["--responses-store-max-entries", "7", "--responses-store-max-bytes", "4096"])
    config = config_from_args(gateway_parser().parse_args(service_argv(args, engine_args)[
        "gateway"][2:]))
    assert (config.responses_store_max_entries, config.responses_store_max_bytes) == (7, 4096)
