"""The gateway's gRPC front door (`Gateway.Generate`), health and reflection, against fake workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer

TEXT = " Paris is the capital of France. It is known for the Eiffel Tower."


@pytest.fixture(scope="module")
def script_ids() -> list[int]:
    return smollm2_tokenizer().encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def gw(script_ids: list[int]) -> Iterator[Harness]:
    with Harness(Script(list(script_ids), num_cached_tokens=2)) as h:
        yield h


@pytest.fixture()
def channel(gw: Harness) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gw.grpc_target) as ch:
        yield ch


def _generate(channel: grpc.Channel, **fields: object) -> list[gateway_pb2.GenerateResponse]:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    return list(stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=20))  # type: ignore[arg-type]


def _text(ids: list[int]) -> str:
    return smollm2_tokenizer().decode(ids)


def test_generate_text_streams_chunks_then_complete(channel: grpc.Channel, script_ids: list[int]) -> None:
    out = _generate(channel, text="Hello", sampling=common_pb2.SamplingParams(max_tokens=6),
                    model=MODEL_NAME, skip_special_tokens=True)
    chunks = [r.chunk for r in out if r.WhichOneof("response") == "chunk"]
    assert [t for c in chunks for t in c.token_ids] == script_ids[:6]
    assert "".join(c.text for c in chunks) == _text(script_ids[:6])
    assert out[-1].WhichOneof("response") == "complete"
    done = out[-1].complete
    assert done.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.cached_tokens) == (
        len(smollm2_tokenizer().encode("Hello")), 6, 2)


def test_generate_token_ids_chat_stop_and_n(channel: grpc.Channel, script_ids: list[int]) -> None:
    out = _generate(channel, token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3]), stop=["capital"],
                    sampling=common_pb2.SamplingParams(max_tokens=30), skip_special_tokens=True)
    assert "".join(r.chunk.text for r in out) == " Paris is the "
    assert out[-1].complete.finish_reason == common_pb2.FINISH_REASON_STOP
    assert out[-1].complete.stop_reason == "capital"
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    out = _generate(channel, chat=chat, n=2, sampling=common_pb2.SamplingParams(max_tokens=3),
                    skip_special_tokens=True)
    completes = [r.complete for r in out if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1]
    for index in (0, 1):
        text = "".join(r.chunk.text for r in out
                       if r.WhichOneof("response") == "chunk" and r.chunk.index == index)
        assert text == _text(script_ids[:3])


def test_generate_logprobs(channel: grpc.Channel) -> None:
    out = _generate(channel, text="x", sampling=common_pb2.SamplingParams(max_tokens=3, logprobs=2),
                    skip_special_tokens=True)
    lps = [lp for r in out if r.WhichOneof("response") == "chunk" for lp in r.chunk.logprobs]
    assert len(lps) == 3 and all(len(lp.top) == 2 for lp in lps)


def test_generate_passes_logit_bias_and_allowed_token_ids(gw: Harness, channel: grpc.Channel) -> None:
    _generate(channel, text="x", sampling=common_pb2.SamplingParams(
        max_tokens=2, logit_bias={7: -3.5}, allowed_token_ids=[7, 8]))
    sent = gw.prefill[0].prefill_requests[-1].sampling
    assert dict(sent.logit_bias) == {7: -3.5} and list(sent.allowed_token_ids) == [7, 8]


def test_generate_passes_bad_words_and_truncates(gw: Harness, channel: grpc.Channel) -> None:
    """`sampling.bad_words` reach both workers; `truncate_prompt_tokens` cuts token-id, text
    and chat prompts to their last k tokens, which usage counts."""
    ids = list(range(600, 612))
    out = _generate(channel, token_ids=gateway_pb2.TokenIds(ids=ids), truncate_prompt_tokens=5,
                    sampling=common_pb2.SamplingParams(max_tokens=2, bad_words=["Paris", "Tower"]))
    assert list(gw.prefill[0].prefill_requests[-1].prompt_token_ids) == ids[-5:]
    assert list(gw.prefill[0].prefill_requests[-1].sampling.bad_words) == ["Paris", "Tower"]
    assert list(gw.decode[0].decode_requests[-1].sampling.bad_words) == ["Paris", "Tower"]
    assert out[-1].complete.usage.prompt_tokens == 5
    text = "The capital of France is a city of bridges"
    out = _generate(channel, text=text, truncate_prompt_tokens=2,
                    sampling=common_pb2.SamplingParams(max_tokens=2))
    assert list(gw.prefill[0].prefill_requests[-1].prompt_token_ids) == \
        smollm2_tokenizer().encode(text)[-2:]
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    out = _generate(channel, chat=chat, truncate_prompt_tokens=3,
                    sampling=common_pb2.SamplingParams(max_tokens=2))
    assert len(gw.prefill[0].prefill_requests[-1].prompt_token_ids) == 3
    assert out[-1].complete.usage.prompt_tokens == 3
    # Past the gateway's prompt limit (255 tokens), cut below it: served.
    out = _generate(channel, token_ids=gateway_pb2.TokenIds(ids=[5] * 400),
                    truncate_prompt_tokens=8, sampling=common_pb2.SamplingParams(max_tokens=2))
    assert out[-1].complete.usage.prompt_tokens == 8


@pytest.mark.parametrize(("fields", "words"), [
    ({"text": "x", "truncate_prompt_tokens": 0}, ["truncate_prompt_tokens", "-1", ">= 1"]),
    ({"text": "x", "truncate_prompt_tokens": -2}, ["truncate_prompt_tokens"]),
    ({"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user",
                                                                         content="hi")]),
      "truncate_prompt_tokens": 0}, ["truncate_prompt_tokens"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(bad_words=[" "])},
     ["sampling.bad_words", "non-blank"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(bad_words=["w"] * 129)},
     ["sampling.bad_words", "at most 128"]),
])
def test_bad_words_and_truncation_validation(gw: Harness, channel: grpc.Channel,
                                             fields: dict[str, object], words: list[str]) -> None:
    sent = len(gw.prefill[0].prefill_requests)
    with pytest.raises(grpc.RpcError) as info:
        _generate(channel, **fields)
    err: grpc.Call = info.value  # type: ignore[assignment]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    for w in words:
        assert w in (err.details() or ""), (w, err.details())
    assert len(gw.prefill[0].prefill_requests) == sent


def test_embed_refuses_a_bad_truncation(channel: grpc.Channel) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(gateway_pb2.EmbeddingsRequest(inputs=[gateway_pb2.EmbeddingInput(text="x")],
                                                 truncate_prompt_tokens=0), timeout=20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "truncate_prompt_tokens" in (info.value.details() or "")  # type: ignore[attr-defined]


@pytest.mark.parametrize(("fields", "code", "words"), [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, ["input"]),
    ({"token_ids": gateway_pb2.TokenIds(ids=[])}, grpc.StatusCode.INVALID_ARGUMENT, ["token_ids.ids"]),
    ({"token_ids": gateway_pb2.TokenIds(ids=[4, 10**6])}, grpc.StatusCode.INVALID_ARGUMENT,
     ["token_ids.ids[1]"]),
    ({"text": "x", "model": "other"}, grpc.StatusCode.NOT_FOUND, ["other"]),
    ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, ["text must not be empty"]),
    ({"text": "x", "n": 50}, grpc.StatusCode.INVALID_ARGUMENT, ["n must be at most"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(temperature=-1)},
     grpc.StatusCode.INVALID_ARGUMENT, ["sampling.temperature"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(max_tokens=10_000)},
     grpc.StatusCode.INVALID_ARGUMENT, ["sampling.max_tokens"]),
    ({"token_ids": gateway_pb2.TokenIds(ids=[5] * 400)}, grpc.StatusCode.INVALID_ARGUMENT,
     ["400", "prompt"]),
    ({"chat": gateway_pb2.ChatMessages()}, grpc.StatusCode.INVALID_ARGUMENT, ["chat.messages"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(logit_bias={3: 150.0})},
     grpc.StatusCode.INVALID_ARGUMENT, ["sampling.logit_bias", "[-100, 100]"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(allowed_token_ids=[10**6])},
     grpc.StatusCode.INVALID_ARGUMENT, ["sampling.allowed_token_ids", "vocabulary"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(structured_outputs=common_pb2.StructuredOutputs(
        json_object=True, reasoning_end_token_id=10**6))},
     grpc.StatusCode.INVALID_ARGUMENT, ["sampling.structured_outputs", "vocabulary", "1000000"]),
    ({"text": "x", "sampling": common_pb2.SamplingParams(structured_outputs=common_pb2.StructuredOutputs(
        regex="a+", reasoning_start_token_id=3))},
     grpc.StatusCode.INVALID_ARGUMENT, ["sampling.structured_outputs", "needs a different"]),
])
def test_generate_validation(channel: grpc.Channel, fields: dict[str, object],
                             code: grpc.StatusCode, words: list[str]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(channel, **fields)
    err: grpc.Call = info.value  # type: ignore[assignment]
    assert err.code() == code, err.details()
    for w in words:
        assert w in (err.details() or ""), (w, err.details())


def test_downstream_failure_keeps_status(script_ids: list[int]) -> None:
    with Harness(Script(list(script_ids), decode_error=grpc.StatusCode.RESOURCE_EXHAUSTED)) as h, \
            grpc.insecure_channel(h.grpc_target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        received: list[gateway_pb2.GenerateResponse] = []
        with pytest.raises(grpc.RpcError) as info:
            for r in stub.Generate(gateway_pb2.GenerateRequest(text="x"), timeout=20):
                received.append(r)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert received[0].WhichOneof("response") == "chunk"  # the prefill token came first
        assert received[-1].WhichOneof("response") == "error"
        assert received[-1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_health_and_reflection(gw: Harness, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "splitserve.v1.Gateway"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"splitserve.v1.Gateway", "grpc.health.v1.Health"} <= names


def test_health_not_serving_without_workers(script_ids: list[int]) -> None:
    with Harness(Script(list(script_ids)), dead_decode=True) as h, \
            grpc.insecure_channel(h.grpc_target) as ch:
        h.run(h.prefill[0].stop())  # no worker of either pool left
        time.sleep(1.0)  # a poll round or more: health follows
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            _generate(ch, text="x")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_gateway_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, gateway.server, gateway.grpc_server, gateway.openai_api;"
            "from gateway.tokenization import load_tokenizer, make_detokenizer;"
            "t = load_tokenizer('');"
            "make_detokenizer(t, [1], skip_special_tokens=True, stop=[], include_stop_str_in_output=False);"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    root = Path(__file__).resolve().parents[3]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


def test_router_least_loaded_round_robin_and_exclusion(script_ids: list[int]) -> None:
    from gateway.router import WorkerPool

    with Harness(Script(list(script_ids)), num_decode=3) as h:
        busy, idle_a, idle_b = h.decode
        busy.num_running = 5

        async def picks() -> list[str]:
            pool = WorkerPool("decode", [w.address for w in h.decode], poll_interval_s=60)
            await pool.start()
            try:
                chosen = [pool.pick().address for _ in range(4)]
                # Picks since the last poll count as load, so the idle two share the work.
                pool.mark_failed(idle_a.address)
                chosen.append(pool.pick().address)
                chosen.append(pool.pick(exclude=[idle_b.address]).address)
                return chosen
            finally:
                await pool.close()

        chosen = h.run(picks())
        assert sorted(chosen[:4]) == sorted([idle_a.address, idle_b.address] * 2)
        assert chosen[4] == idle_b.address   # idle_a is excluded after a failure
        assert chosen[5] == busy.address     # the only healthy one left


def test_a_long_scored_prompt_fits_and_a_too_long_one_is_refused(script_ids: list[int]) -> None:
    """A scored 200k-token prompt's logprobs (~7 MB with 5 top entries, above gRPC's default
    4 MB) reach the client through the gateway; scoring 300k tokens with 20 top logprobs each
    could outgrow a worker's message limit: refused up front, naming the field."""
    limits = {"max_model_len": 400_000, "max_prompt_tokens": 400_000}
    ids = [(7 * i) % 1000 + 1 for i in range(200_000)]
    with Harness(Script(list(script_ids)), **limits) as h, grpc.insecure_channel(
            h.grpc_target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        out = _generate(ch, token_ids=gateway_pb2.TokenIds(ids=ids),
                        sampling=common_pb2.SamplingParams(max_tokens=1, prompt_logprobs=5))
        scored = [r.chunk.prompt_logprobs for r in out if r.WhichOneof("response") == "chunk"]
        assert list(scored[0].token_ids) == ids[1:] and scored[0].num_top == 5
        assert len(scored[0].top_logprobs) == 5 * len(ids[1:])
        with pytest.raises(grpc.RpcError) as err:
            _generate(ch, token_ids=gateway_pb2.TokenIds(ids=[*ids, *ids[:100_000]]),
                      sampling=common_pb2.SamplingParams(max_tokens=1, prompt_logprobs=20))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.prompt_logprobs" in (err.value.details() or "")
        assert "MiB" in (err.value.details() or "")


@pytest.mark.parametrize("method", ["Generate", "Embed"])
def test_a_corrupt_request_is_invalid_argument(channel: grpc.Channel, method: str) -> None:
    """Bytes that do not parse as the method's message are the caller's error (not UNKNOWN)."""
    call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
        f"/splitserve.v1.Gateway/{method}")
    with pytest.raises(grpc.RpcError) as info:
        result = call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)
        if method == "Generate":
            list(result)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert f"not a valid {method} message" in (info.value.details() or "")
    assert _generate(channel, text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))
