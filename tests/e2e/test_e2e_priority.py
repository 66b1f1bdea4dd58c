"""Request priority end to end (vLLM's `priority` extra and `--scheduling-policy priority`):
REST (`extra_body`) and gRPC requests carry it through the gateway to the prefill, decode and
embed calls of real SmolLM2 workers.

- The default (FCFS) stacks take priority 0 and refuse any other with a 400 / INVALID_ARGUMENT
  carrying the refusing worker's message; a priority that is not an int32 is the gateway's 400.
- A stack whose workers are started as `splitserve up --scheduling-policy priority` starts them
  (the flag handed to both through `up`'s worker command lines): every priority completes
  with the greedy output of priority 0, and an urgent request overtakes running ones (it
  preempts the least urgent on the decode worker), the preempted one still exact.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import BadRequestError, OpenAI  # noqa: E402

from engine.cli_args import engine_config_from_args  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from gateway.server import GatewayServer  # noqa: E402
from protos.splitserve.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from splitserve.serve import build_serve_parser  # noqa: E402
from splitserve.up import build_parser as up_parser  # noqa: E402
from splitserve.up import service_argv  # noqa: E402
from tests.support.e2e_stack import (  # noqa: E402
    BLOCK_SIZE,
    HOST,
    INTERNAL_TOKEN,
    KV_LEASE_MS,
    LOAD_TIMEOUT_S,
    MAX_MODEL_LEN,
    MODEL_NAME,
    RPC_TIMEOUT_S,
    LoopThread,
    Stack,
    greedy_sampling,
    start_worker,
    wait_healthy,
)
from worker.server import WorkerHandle  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Honey bees live in", "A lighthouse keeper watches"]
MAX_TOKENS = 6
LONG_MAX_TOKENS = 64  # the running requests an urgent one overtakes
# The priority stack's engines: fewer blocks than the shared stacks' (a few short requests),
# at most two running requests per worker, so that a third must wait or preempt.
PRIORITY_ENGINE_ARGS = ["--scheduling-policy", "priority", "--device", "cpu",
                        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", "128",
                        "--max-model-len", str(MAX_MODEL_LEN), "--kv-lease-ms", str(KV_LEASE_MS),
                        "--max-num-seqs", "2"]
REFUSAL = "scheduling policy"  # what an FCFS engine's refusal of a priority says


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.rest_url, api_key="x", max_retries=0, timeout=RPC_TIMEOUT_S)


def _complete(client: OpenAI, prompt: str, priority: int | None = None,
              max_tokens: int = MAX_TOKENS) -> str:
    """A greedy completion's text (`priority` None: not sent at all)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if priority is not None:
        extra["priority"] = priority
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body=extra)
    return out.choices[0].text


def _generate(stack: Stack, prompt_ids: list[int], max_tokens: int,
              priority: int) -> list[int]:
    """Greedy `Gateway.Generate` of token ids at `priority`: the tokens."""
    with grpc.insecure_channel(stack.grpc_target) as channel:
        responses = gateway_pb2_grpc.GatewayStub(channel).Generate(
            _request(prompt_ids, max_tokens, priority), timeout=RPC_TIMEOUT_S)
        return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]


def _request(prompt_ids: list[int], max_tokens: int, priority: int
             ) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids),
                                       sampling=greedy_sampling(max_tokens), priority=priority)


def _grpc_refusal(call: Callable[[], object]) -> str:
    """`call` must fail with INVALID_ARGUMENT: its message."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    return str(err.details())


# -- the default (FCFS) stacks ------------------------------------------------------------------
# The worker that refuses a priority: the one each stack sends the prompt to first.
_FIRST_HOP = {"disagg": "prefill worker", "colocated": "decode worker"}


def _fcfs_stack(which: str, disagg_stack: Stack, colocated_stack: Stack) -> Stack:
    return disagg_stack if which == "disagg" else colocated_stack


@pytest.mark.parametrize("which", ["disagg", "colocated"])
def test_fcfs_workers_take_priority_zero_only(which: str, disagg_stack: Stack,
                                              colocated_stack: Stack) -> None:
    stack = _fcfs_stack(which, disagg_stack, colocated_stack)
    client = _client(stack)
    assert _complete(client, PROMPTS[0], priority=0) == _complete(client, PROMPTS[0])
    with pytest.raises(BadRequestError) as info:
        _complete(client, PROMPTS[0], priority=3)
    body: Any = info.value.body  # the response's "error" object
    assert info.value.status_code == 400 and body["type"] == "invalid_request_error", body
    assert body["message"].startswith(_FIRST_HOP[which]), body
    assert "priority 3" in body["message"] and REFUSAL in body["message"], body
    with pytest.raises(BadRequestError, match=REFUSAL):  # a stream fails before it starts
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2, stream=True,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"priority": -1})
    with pytest.raises(BadRequestError, match=f"embed worker: .*{REFUSAL}"):
        client.embeddings.create(model=MODEL_NAME, input="Hi", extra_body={"priority": 3})
    stack.wait_idle()


@pytest.mark.parametrize("which", ["disagg", "colocated"])
def test_fcfs_workers_refuse_a_grpc_priority(which: str, disagg_stack: Stack,
                                             colocated_stack: Stack) -> None:
    stack = _fcfs_stack(which, disagg_stack, colocated_stack)
    ids = stack.tokenizer.encode(PROMPTS[1])
    assert _generate(stack, ids, MAX_TOKENS, 0)  # 0: the default, taken by every worker
    message = _grpc_refusal(lambda: _generate(stack, ids, MAX_TOKENS, -7))
    assert message.startswith(_FIRST_HOP[which]) and REFUSAL in message, message
    with grpc.insecure_channel(stack.grpc_target) as channel:
        embed = gateway_pb2_grpc.GatewayStub(channel).Embed
        message = _grpc_refusal(lambda: embed(gateway_pb2.EmbeddingsRequest(
            inputs=[gateway_pb2.EmbeddingInput(text="Hi")], priority=2), timeout=RPC_TIMEOUT_S))
    assert REFUSAL in message, message
    stack.wait_idle()


@pytest.mark.parametrize("path", ["/completions", "/chat/completions", "/embeddings"])
@pytest.mark.parametrize("priority", ["high", 2**40, True])
def test_the_gateway_refuses_a_priority_that_is_no_int32(disagg_stack: Stack, path: str,
                                                         priority: object) -> None:
    body = {"model": MODEL_NAME, "priority": priority, "prompt": "x", "input": "x",
            "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(disagg_stack.rest_url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", "priority"), err
    assert err["message"].startswith("priority: "), err


# -- a stack of priority workers ----------------------------------------------------------------
def priority_engine_config(role: str) -> EngineConfig:
    """The engine a worker builds from the command line `splitserve up` gives it, with
    PRIORITY_ENGINE_ARGS among `up`'s engine flags."""
    args, engine_args = up_parser().parse_known_args(PRIORITY_ENGINE_ARGS)
    worker_args = build_serve_parser().parse_args(service_argv(args, engine_args)[role])
    return engine_config_from_args(worker_args, role=worker_args.role)


@pytest.fixture(scope="module")
def priority_stack(loop_thread: LoopThread, disagg_stack: Stack) -> Iterator[Stack]:
    """Gateway → 1 prefill + 1 decode worker scheduling by priority (as the shared
    disaggregated stack otherwise: same model, authenticated, KV pulled from prefill)."""
    async def start() -> dict[str, WorkerHandle]:
        workers = {role: await start_worker(priority_engine_config(role), HOST, 0,
                                            auth_token=INTERNAL_TOKEN)
                   for role in ("prefill", "decode")}
        loads = [w.load_task for w in workers.values() if w.load_task is not None]
        await asyncio.wait_for(asyncio.gather(*loads), LOAD_TIMEOUT_S)  # both load at once
        return workers

    workers = loop_thread.run(start(), LOAD_TIMEOUT_S + 30)
    stack = Stack(loop_thread, workers, _gateway(disagg_stack, workers["prefill"],
                                                 workers["decode"]), INTERNAL_TOKEN)
    try:
        loop_thread.run(stack.gateway.start(), 120)
        wait_healthy(f"http://{HOST}:{stack.gateway.rest_port}/health", 60)
        yield stack
    finally:
        stack.stop()


def _gateway(shared: Stack, prefill: WorkerHandle, decode: WorkerHandle) -> GatewayServer:
    """A gateway configured as the shared stack's, in front of the given workers."""
    config = shared.gateway.config.replace(prefill_addresses=(f"{HOST}:{prefill.port}",),
                                           decode_addresses=(f"{HOST}:{decode.port}",))
    return GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST, grpc_port=0,
                         tokenizer=shared.tokenizer)


def test_up_hands_the_policy_to_both_workers(priority_stack: Stack) -> None:
    assert [e.config.scheduler.policy for e in priority_stack.engines] == ["priority"] * 2


def test_every_priority_completes_as_priority_zero(priority_stack: Stack) -> None:
    """Six requests at once (more than the two seats per worker), priorities from the int32
    minimum to its maximum: each equals its prompt's greedy text at priority 0."""
    client = _client(priority_stack)
    want = {p: _complete(client, p, priority=0) for p in PROMPTS}
    asked = [(PROMPTS[i % len(PROMPTS)], priority)
             for i, priority in enumerate([5, -(2**31), 0, 2**31 - 1, -3, 1])]
    got: dict[int, str] = {}

    def run(i: int) -> None:
        got[i] = _complete(client, *asked[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RPC_TIMEOUT_S)
    assert got == {i: want[prompt] for i, (prompt, _) in enumerate(asked)}
    chat = [client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"priority": p}).choices[0].message
        for p in (0, -9)]
    assert chat[0].content == chat[1].content
    vectors = [client.embeddings.create(model=MODEL_NAME, input=PROMPTS[0],
                                        encoding_format="float",
                                        extra_body={"priority": p}).data[0].embedding
               for p in (0, 4)]
    # (The prompt's blocks are cached by now: a prefix hit may change the last bits.)
    assert vectors[1] == pytest.approx(vectors[0], rel=1e-4, abs=2e-5)
    priority_stack.wait_idle()


@dataclass
class _Streamed:
    """A `Gateway.Generate` stream consumed in a thread."""

    tokens: list[int] = field(default_factory=list)
    decoding: threading.Event = field(default_factory=threading.Event)  # a decode token came
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _stream_in_thread(stack: Stack, request: gateway_pb2.GenerateRequest
                      ) -> tuple[_Streamed, threading.Thread]:
    out = _Streamed()

    def consume() -> None:
        try:
            with grpc.insecure_channel(stack.grpc_target) as channel:
                for r in gateway_pb2_grpc.GatewayStub(channel).Generate(request,
                                                                        timeout=RPC_TIMEOUT_S):
                    out.tokens.extend(r.chunk.token_ids)
                    if len(out.tokens) >= 2:  # the first is prefill's, the second decode's
                        out.decoding.set()
        except BaseException as err:  # reported by the test
            out.error = err
        finally:
            out.decoding.set()
            out.done.set()

    thread = threading.Thread(target=consume)
    thread.start()
    return out, thread


def test_an_urgent_grpc_request_overtakes_running_ones(priority_stack: Stack) -> None:
    """Two long requests fill the decode worker's two seats; a more urgent one arriving then
    preempts the less urgent of them instead of waiting for a seat (FCFS would make it wait
    the long ones' LONG_MAX_TOKENS steps), so it completes while both still run. All three
    equal their greedy tokens at priority 0, the preempted one (recomputed) included."""
    tok = priority_stack.tokenizer
    long_ids, short_ids = tok.encode(PROMPTS[2]), tok.encode(PROMPTS[0])
    want_long = _generate(priority_stack, long_ids, LONG_MAX_TOKENS, 0)
    want_short = _generate(priority_stack, short_ids, MAX_TOKENS, 0)
    decode = priority_stack.workers["decode"].aengine
    assert decode is not None
    preemptions = decode.engine.scheduler.num_preemptions
    running = [_stream_in_thread(priority_stack, _request(long_ids, LONG_MAX_TOKENS, p))
               for p in (5, 9)]
    for streamed, _ in running:
        assert streamed.decoding.wait(RPC_TIMEOUT_S)
    assert _generate(priority_stack, short_ids, MAX_TOKENS, -1) == want_short
    overtaken = [not streamed.done.is_set() for streamed, _ in running]
    for streamed, thread in running:
        thread.join(RPC_TIMEOUT_S)
        assert streamed.error is None, streamed.error
        assert streamed.tokens == want_long
    assert overtaken == [True, True], "the urgent request waited for a running one to finish"
    assert decode.engine.scheduler.num_preemptions > preemptions
    priority_stack.wait_idle()


def test_the_decode_call_carries_the_priority(priority_stack: Stack,
                                              disagg_stack: Stack) -> None:
    """Prefill on a priority worker, decode on an FCFS one: the decode worker refuses the
    priority the gateway sent it too (a 400 naming it), and the prefill lease is released."""
    gateway = _gateway(disagg_stack, priority_stack.workers["prefill"],
                       disagg_stack.workers["decode"])
    priority_stack.loop.run(gateway.start(), 120)
    try:
        wait_healthy(f"http://{HOST}:{gateway.rest_port}/health", 60)
        client = OpenAI(base_url=f"http://{HOST}:{gateway.rest_port}/v1", api_key="x",
                        max_retries=0, timeout=RPC_TIMEOUT_S)
        assert _complete(client, PROMPTS[1], priority=0)  # 0: both workers take it
        with pytest.raises(BadRequestError) as info:
            _complete(client, PROMPTS[1], priority=2)
        body: Any = info.value.body
        assert body["message"].startswith("decode worker: ") and REFUSAL in body["message"], body
    finally:
        priority_stack.loop.run(gateway.stop(), 60)
    priority_stack.wait_idle()
    disagg_stack.wait_idle()
