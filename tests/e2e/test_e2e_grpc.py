"""A gRPC client against `Gateway.Generate` on the disaggregated stack (real SmolLM2)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from engine_api.tokenizer import Tokenizer  # noqa: E402
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import MAX_MODEL_LEN, MODEL_NAME, Stack, generate, greedy_sampling  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def stub(disagg_stack: Stack) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def _call(stub: gateway_pb2_grpc.GatewayStub, **fields: object) -> list[gateway_pb2.GenerateResponse]:
    return list(stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=TIMEOUT_S))  # type: ignore[arg-type]


def _invalid(stub: gateway_pb2_grpc.GatewayStub, **fields: object) -> str:
    """Call and expect INVALID_ARGUMENT; returns the status message."""
    with pytest.raises(grpc.RpcError) as info:
        _call(stub, **fields)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())  # type: ignore[attr-defined]
    return str(err.details())  # type: ignore[attr-defined]


def test_text_input_streams_chunks_then_complete(stub: gateway_pb2_grpc.GatewayStub,
                                                  tokenizer: Tokenizer) -> None:
    text = "The capital of France is"
    out = _call(stub, text=text, sampling=greedy_sampling(8), model=MODEL_NAME,
                skip_special_tokens=True)
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}, kinds
    assert len(kinds) >= 3  # the first token (prefill) and decode tokens arrive separately
    ids = [t for r in out[:-1] for t in r.chunk.token_ids]
    assert len(ids) == 8
    assert "".join(r.chunk.text for r in out[:-1]) == tokenizer.decode(ids)
    done = out[-1].complete
    assert done.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert done.usage.prompt_tokens == len(tokenizer.encode(text))
    assert done.usage.completion_tokens == 8
    assert "Paris" in tokenizer.decode(ids)


def test_token_id_input_equals_text_input(stub: gateway_pb2_grpc.GatewayStub,
                                          disagg_stack: Stack, tokenizer: Tokenizer) -> None:
    text = "Water boils at"
    by_ids = generate(disagg_stack.grpc_target, tokenizer.encode(text), 8)
    out = _call(stub, text=text, sampling=greedy_sampling(8), skip_special_tokens=True)
    assert [t for r in out[:-1] for t in r.chunk.token_ids] == by_ids.token_ids
    assert by_ids.complete.usage.prompt_tokens == len(tokenizer.encode(text))


def test_chat_input(stub: gateway_pb2_grpc.GatewayStub) -> None:
    chat = gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(role="user", content="What is the capital of France?")])
    out = _call(stub, chat=chat, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=16),
                skip_special_tokens=True)
    assert out[-1].WhichOneof("response") == "complete"
    assert "Paris" in "".join(r.chunk.text for r in out[:-1])


def test_missing_input_is_invalid(stub: gateway_pb2_grpc.GatewayStub) -> None:
    assert "input" in _invalid(stub, sampling=greedy_sampling(4))


def test_empty_token_ids_are_invalid(stub: gateway_pb2_grpc.GatewayStub) -> None:
    assert "token_ids" in _invalid(stub, token_ids=gateway_pb2.TokenIds(ids=[]))


def test_token_id_outside_vocab_is_invalid(stub: gateway_pb2_grpc.GatewayStub) -> None:
    msg = _invalid(stub, token_ids=gateway_pb2.TokenIds(ids=[1, 2, 10_000_000]),
                   sampling=greedy_sampling(4))
    assert "token_ids" in msg and "10000000" in msg


def test_prompt_longer_than_context_is_invalid(stub: gateway_pb2_grpc.GatewayStub) -> None:
    msg = _invalid(stub, token_ids=gateway_pb2.TokenIds(ids=[42] * (MAX_MODEL_LEN + 10)),
                   sampling=greedy_sampling(4))
    assert str(MAX_MODEL_LEN + 10) in msg and "prompt" in msg


def test_max_tokens_past_context_is_invalid(stub: gateway_pb2_grpc.GatewayStub) -> None:
    msg = _invalid(stub, token_ids=gateway_pb2.TokenIds(ids=[42] * 100),
                   sampling=greedy_sampling(MAX_MODEL_LEN))
    assert "max_tokens" in msg


def test_bad_sampling_is_invalid(stub: gateway_pb2_grpc.GatewayStub) -> None:
    msg = _invalid(stub, text="hi", sampling=common_pb2.SamplingParams(temperature=-1.0,
                                                                       max_tokens=4))
    assert "temperature" in msg
    msg = _invalid(stub, text="hi", sampling=common_pb2.SamplingParams(top_p=1.5, max_tokens=4))
    assert "top_p" in msg


def test_unknown_model_is_not_found(stub: gateway_pb2_grpc.GatewayStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(stub, text="hi", model="gpt-4", sampling=greedy_sampling(4))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert "gpt-4" in str(info.value.details())  # type: ignore[attr-defined]
