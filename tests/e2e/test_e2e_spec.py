"""Speculative decoding through the services: a real colocated worker (SmolLM2, n-gram prompt
lookup with 4 drafts per step) behind its real `Decode` gRPC server, then real gateways in front
of it with different speculative policies.

The prompt counts in a loop, so the n-gram proposer finds drafts at every step; the worker's
draft counter (from `GetLoad`, the report the gateway mirrors into /metrics) shows whether a
request speculated. Greedy speculation must not change a single token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.loader.load import default_model_path  # noqa: E402
from engine_api.tokenizer import Tokenizer  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.server import GatewayServer  # noqa: E402
from protos.splitserve.v1 import (  # noqa: E402
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)
from tests.support.e2e_stack import (  # noqa: E402
    HOST,
    LOAD_TIMEOUT_S,
    LoopThread,
    Stack,
    generate,
    generate_many,
    greedy_sampling,
    start_stack,
    start_worker,
    wait_engines_idle,
)
from worker.server import WorkerHandle  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
RPC_TIMEOUT_S = 60.0
PROMPT = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"


@pytest.fixture(scope="module")
def worker(loop_thread: LoopThread) -> Iterator[WorkerHandle]:
    config = EngineConfig(
        cache=CacheConfig(block_size=16, num_gpu_blocks=64),
        scheduler=SchedulerConfig(role="colocated", max_model_len=512),
        runner=RunnerConfig(device="cpu"),
        # A small start-up calibration (batches 1 and 2): the adaptive policy's test reads it.
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                      calibration_max_batch=2))

    async def start() -> WorkerHandle:
        handle = await start_worker(config, HOST, 0)
        assert handle.load_task is not None
        await asyncio.wait_for(asyncio.shield(handle.load_task), LOAD_TIMEOUT_S)
        # Ready before its calibration ran (it runs while idle): the tests read its points.
        assert handle.calibration is not None
        assert await asyncio.wait_for(asyncio.shield(handle.calibration), 60) > 0
        return handle

    handle = loop_thread.run(start(), LOAD_TIMEOUT_S + 30)
    yield handle
    loop_thread.run(handle.stop(1.0), 60)


@pytest.fixture(scope="module")
def spec_tokenizer(worker: WorkerHandle) -> Tokenizer:
    assert worker.aengine is not None and worker.aengine.engine.tokenizer is not None
    return worker.aengine.engine.tokenizer


@pytest.fixture(scope="module")
def prompt_ids(spec_tokenizer: Tokenizer) -> list[int]:
    return spec_tokenizer.encode(PROMPT)


@pytest.fixture()
def stub(worker: WorkerHandle) -> Iterator[decode_pb2_grpc.DecodeStub]:
    with grpc.insecure_channel(f"{HOST}:{worker.port}") as channel:
        yield decode_pb2_grpc.DecodeStub(channel)


def _drafts(stub: decode_pb2_grpc.DecodeStub) -> tuple[int, int]:
    """(draft tokens verified, accepted) so far, as the worker reports them to the router."""
    report = stub.GetLoad(common_pb2.LoadRequest(), timeout=RPC_TIMEOUT_S)
    return report.spec_draft_tokens, report.spec_accepted_tokens


def _decode(stub: decode_pb2_grpc.DecodeStub, request_id: str, prompt_ids: list[int],
            spec: int | None) -> list[int]:
    request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                       sampling=greedy_sampling(MAX_TOKENS))
    if spec is not None:
        request.num_speculative_tokens = spec
    responses = list(stub.Decode(request, timeout=RPC_TIMEOUT_S))
    assert responses[-1].WhichOneof("response") == "complete"
    assert responses[-1].complete.num_output_tokens == MAX_TOKENS
    return [t for r in responses[:-1] for t in r.chunk.token_ids]


@pytest.fixture(scope="module")
def plain_tokens(worker: WorkerHandle, prompt_ids: list[int]) -> list[int]:
    """The worker's greedy output without speculation (asked for 0 drafts)."""
    with grpc.insecure_channel(f"{HOST}:{worker.port}") as channel:
        return _decode(decode_pb2_grpc.DecodeStub(channel), "plain", prompt_ids, 0)


@pytest.mark.parametrize(("spec", "speculates"), [(None, True), (0, False), (4, True),
                                                  (16, True), (1, True)])
def test_decode_field_reaches_the_engine(stub: decode_pb2_grpc.DecodeStub, prompt_ids: list[int],
                                         plain_tokens: list[int], spec: int | None,
                                         speculates: bool, spec_tokenizer: Tokenizer) -> None:
    """Absent: the worker's default (4); 0: off; n: at most n (16 is capped at 4). Same tokens."""
    before, accepted_before = _drafts(stub)
    tokens = _decode(stub, f"spec-{spec}", prompt_ids, spec)
    after, accepted_after = _drafts(stub)
    assert tokens == plain_tokens, spec_tokenizer.decode(tokens)
    if speculates:
        assert after > before, "speculation was asked for, but no draft was verified"
        # The model continues the count, so the prompt-lookup drafts are mostly right.
        assert accepted_after > accepted_before
        # At most the cap per step, and one step yields a token at least.
        assert after - before <= min(spec if spec is not None else 4, 4) * MAX_TOKENS
    else:
        assert (after, accepted_after) == (before, accepted_before)


def test_bad_num_speculative_tokens_is_invalid_argument(stub: decode_pb2_grpc.DecodeStub,
                                                        prompt_ids: list[int],
                                                        plain_tokens: list[int],
                                                        worker: WorkerHandle,
                                                        loop_thread: LoopThread) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _decode(stub, "too-many", prompt_ids, 99)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "num_speculative_tokens" in str(err.details())  # type: ignore[attr-defined]
    assert "99" in str(err.details())  # type: ignore[attr-defined]
    # Nothing was queued or held, and the worker keeps serving.
    wait_engines_idle(loop_thread, [worker], 30)
    assert _decode(stub, "after-bad", prompt_ids, 4) == plain_tokens


# -- through a gateway ------------------------------------------------------------------------
def _start_gateway(loop: LoopThread, worker: WorkerHandle, tokenizer: Tokenizer,
                   **policy: int | float | str) -> GatewayServer:
    """A gateway in front of `worker`; the load threshold policy unless `policy` names one."""
    policy.setdefault("speculative_policy", "threshold")
    config = GatewayConfig(decode_addresses=(f"{HOST}:{worker.port}",), colocated=True,
                           max_model_len=512, max_prompt_tokens=512, shutdown_grace_s=1.0,
                           **policy)  # type: ignore[arg-type]
    gateway = GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST, grpc_port=0,
                            tokenizer=tokenizer)
    loop.run(gateway.start(), 60)
    return gateway


def _decisions(gateway: GatewayServer) -> dict[str, float]:
    assert gateway.state is not None
    registry = gateway.state.metrics.registry
    return {label: registry.get_sample_value("splitserve:spec_decode_decisions_total",
                                             {"speculation": label}) or 0.0
            for label in ("draft_model", "ngram", "default", "off")}


def _gateway_generate(gateway: GatewayServer, prompt_ids: list[int]) -> list[int]:
    return generate(f"{HOST}:{gateway.grpc_port}", prompt_ids, MAX_TOKENS,
                    timeout_s=RPC_TIMEOUT_S).token_ids


def test_gateway_asks_a_lightly_loaded_worker_to_speculate(
        loop_thread: LoopThread, worker: WorkerHandle, spec_tokenizer: Tokenizer,
        stub: decode_pb2_grpc.DecodeStub, prompt_ids: list[int],
        plain_tokens: list[int]) -> None:
    gateway = _start_gateway(loop_thread, worker, spec_tokenizer, speculative_tokens=4,
                             speculative_max_load=64)
    try:
        before = _drafts(stub)[0]
        assert _gateway_generate(gateway, prompt_ids) == plain_tokens
        after = _drafts(stub)[0]
        assert after > before
        # The n-gram worker reported its method: asked for by name.
        assert _decisions(gateway) == {"draft_model": 0.0, "ngram": 1.0, "default": 0.0,
                                       "off": 0.0}
        # The worker's totals reach the gateway's /metrics with the next load poll.
        assert gateway.state is not None
        loop_thread.run(gateway.state.router.decode.poll_once(), 30)
        r = httpx.get(f"http://{HOST}:{gateway.rest_port}/metrics", timeout=10)
        series = {(s.name, s.labels.get("worker")): s.value
                  for f in text_string_to_metric_families(r.text) for s in f.samples}
        address = f"{HOST}:{worker.port}"
        assert series[("splitserve:spec_decode_num_draft_tokens_total", address)] == after
        assert 0 < series[("splitserve:spec_decode_num_accepted_tokens_total", address)] <= after
    finally:
        loop_thread.run(gateway.stop(), 60)


def test_gateway_with_speculation_off_never_asks(
        loop_thread: LoopThread, worker: WorkerHandle, spec_tokenizer: Tokenizer,
        stub: decode_pb2_grpc.DecodeStub, prompt_ids: list[int],
        plain_tokens: list[int]) -> None:
    gateway = _start_gateway(loop_thread, worker, spec_tokenizer, speculative_tokens=0)
    try:
        before = _drafts(stub)
        assert _gateway_generate(gateway, prompt_ids) == plain_tokens
        assert _drafts(stub) == before  # the worker's default (4) was overridden with 0
        assert _decisions(gateway) == {"draft_model": 0.0, "ngram": 0.0, "default": 0.0,
                                       "off": 1.0}
    finally:
        loop_thread.run(gateway.stop(), 60)


def test_gateway_turns_speculation_off_under_load(
        loop_thread: LoopThread, worker: WorkerHandle, spec_tokenizer: Tokenizer,
        stub: decode_pb2_grpc.DecodeStub, prompt_ids: list[int],
        plain_tokens: list[int]) -> None:
    """No load poll after start-up: the router counts the requests it has in flight on the
    worker, so a request routed while two long ones still decode finds 2 pending and, at
    speculative_max_load=2, is decoded without drafts; once they have ended, the next one
    speculates again (requests that ended are no longer counted, poll or not)."""
    gateway = _start_gateway(loop_thread, worker, spec_tokenizer, speculative_tokens=4,
                             speculative_max_load=2, load_poll_interval_s=600.0)
    target = f"{HOST}:{gateway.grpc_port}"
    assert gateway.state is not None
    decode_worker = gateway.state.router.decode.workers[0]
    long_request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids[:8]),
                                               sampling=greedy_sampling(400))
    try:
        with grpc.insecure_channel(target) as channel:
            # Two long streams (400 tokens, EOS ignored: far longer than the third request),
            # each read to its first chunk, so both are in flight on the worker; cancelled once
            # the third has been routed and answered, which ends them as finishing would.
            stub_gw = gateway_pb2_grpc.GatewayStub(channel)
            long_ones = [stub_gw.Generate(long_request, timeout=4 * RPC_TIMEOUT_S)
                         for _ in range(2)]
            for call in long_ones:
                assert next(call).WhichOneof("response") == "chunk"
            assert decode_worker.in_flight == 2
            assert _gateway_generate(gateway, prompt_ids) == plain_tokens
            for call in long_ones:
                call.cancel()
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while decode_worker.in_flight:
            assert time.monotonic() < deadline, "the cancelled streams are still counted"
            time.sleep(0.01)
        assert _decisions(gateway) == {"draft_model": 0.0, "ngram": 2.0, "default": 0.0,
                                       "off": 1.0}
        before = _drafts(stub)[0]
        assert _gateway_generate(gateway, prompt_ids) == plain_tokens
        assert _drafts(stub)[0] > before
        assert _decisions(gateway)["ngram"] == 3.0
    finally:
        loop_thread.run(gateway.stop(), 60)


def test_adaptive_policy_reads_the_workers_measurements(
        loop_thread: LoopThread, worker: WorkerHandle, spec_tokenizer: Tokenizer,
        stub: decode_pb2_grpc.DecodeStub, prompt_ids: list[int],
        plain_tokens: list[int]) -> None:
    """The worker reports its step cost from start-up on and its acceptance per method and
    class once requests ran; the adaptive gateway (the default) decides from them for the
    request's class, sends the class along, and shows decisions and numbers on /metrics."""
    report = stub.GetLoad(common_pb2.LoadRequest(), timeout=RPC_TIMEOUT_S)
    assert report.max_speculative_tokens == 4 and report.spec_step_budget  # the default
    assert list(report.speculative_methods) == [common_pb2.SPECULATIVE_METHOD_NGRAM,
                                                common_pb2.SPECULATIVE_METHOD_SUFFIX]
    rows = [p.rows for p in report.spec_step_cost]
    assert rows[0] == 1 and max(rows) >= 2 * 5 and all(p.seconds > 0 for p in report.spec_step_cost)
    gateway = _start_gateway(loop_thread, worker, spec_tokenizer, speculative_tokens=4,
                             speculative_policy="adaptive")
    try:
        for _ in range(2):
            assert _gateway_generate(gateway, prompt_ids) == plain_tokens
        assert gateway.state is not None
        loop_thread.run(gateway.state.router.decode.poll_once(), 30)
        r = httpx.get(f"http://{HOST}:{gateway.rest_port}/metrics", timeout=10)
        samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]
        decisions = [s for s in samples
                     if s.name == "splitserve:spec_decode_policy_decisions_total"]
        assert sum(s.value for s in decisions) == 2
        assert {s.labels["request_class"] for s in decisions} == {"repetitive"}
        assert {s.labels["reason"] for s in decisions} <= {"explore", "measured"}
        address = f"{HOST}:{worker.port}"
        by_name = {(s.name, s.labels.get("position")): s.value for s in samples
                   if s.labels.get("worker") == address}
        assert by_name[("splitserve:spec_decode_num_drafts_total", None)] > 0
        assert by_name[("splitserve:spec_decode_num_accepted_tokens_per_pos_total", "0")] > 0
        report = stub.GetLoad(common_pb2.LoadRequest(), timeout=RPC_TIMEOUT_S)
        measured = {(a.method, a.request_class) for a in report.spec_acceptance}
        chosen = {common_pb2.SpeculativeMethod.Value(
            "SPECULATIVE_METHOD_" + s.labels["method"].upper()) for s in decisions}
        assert {(m, "repetitive") for m in chosen} <= measured
        # The worker's own rounds, counted by the drafts it allowed, for what the gateway chose.
        drafted = {(d.method, d.request_class) for d in report.spec_draft_rounds if d.rounds}
        assert {(m, "repetitive") for m in chosen} <= drafted
        assert ("splitserve:spec_decode_draft_rounds_total", None) in by_name
    finally:
        loop_thread.run(gateway.stop(), 60)


# ---- disaggregated with speculation: still the colocated oracle's tokens --------------------

@pytest.fixture(scope="module")
def disagg_spec_stack(loop_thread: LoopThread) -> Iterator[Stack]:
    """Gateway → prefill worker + decode worker that speculates (n-gram, 4 drafts), with the
    policy out of the way: the gateway asks every request for its drafts ("always") and the
    worker keeps them (no step budget). The adaptive policy may rightly turn drafting off for
    a class after a few failed drafts (one request's failures count against the class); this
    test is about the KV handed over and the verify steps on it, not the policy."""
    stack = start_stack(loop_thread, colocated=False,
                        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                      calibration_max_batch=0,
                                                      step_budget=False),
                        gateway_options={"speculative_policy": "always"})
    yield stack
    stack.stop()


def test_disagg_with_speculation_equals_colocated(disagg_spec_stack: Stack,
                                                  colocated_stack: Stack,
                                                  prompts: list[list[int]],
                                                  tokenizer: Tokenizer) -> None:
    """The colocated oracle (docs/architecture.md) holds with speculative decoding on the decode
    worker: the KV pulled from the prefill worker, then verify steps; greedy tokens equal
    colocated plain decoding. The long prompts repeat their own lines (drafts found, often
    rejected); the counting prompt's drafts are right at every step, so accepted drafts are
    certain whatever the timing of the batch."""
    chosen = [*[p for p in prompts if len(p) > 40][:2], tokenizer.encode(PROMPT)]
    # The oracle batched (colocated batched = one by one: test_e2e_disagg.py).
    want = generate_many(colocated_stack.grpc_target, chosen, 32, concurrent=True)
    got = generate_many(disagg_spec_stack.grpc_target, chosen, 32, concurrent=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    decode = disagg_spec_stack.workers["decode"].aengine
    assert decode is not None
    sched = decode.engine.scheduler
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0
    disagg_spec_stack.wait_idle()


@pytest.fixture(scope="module")
def disagg_draft_stack(loop_thread: LoopThread) -> Iterator[Stack]:
    """Gateway → prefill worker + decode worker whose draft model is SmolLM2 itself."""
    draft = SpeculativeConfig(method="draft_model", model=default_model_path(),
                              num_speculative_tokens=4, calibration_max_batch=0)
    stack = start_stack(loop_thread, colocated=False, speculative=draft)
    yield stack
    stack.stop()


def test_disagg_with_a_draft_model_equals_colocated(disagg_draft_stack: Stack,
                                                    colocated_stack: Stack,
                                                    prompts: list[list[int]]) -> None:
    """The oracle with a draft model on the decode worker: its target KV comes from the prefill
    worker, its draft computes the prompt on the first proposal; greedy tokens equal colocated
    plain decoding's, and the target as its own draft has its drafts accepted."""
    chosen = prompts[:3]
    want = generate_many(colocated_stack.grpc_target, chosen, 24, concurrent=True)
    got = generate_many(disagg_draft_stack.grpc_target, chosen, 24, concurrent=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    decode = disagg_draft_stack.workers["decode"].aengine
    assert decode is not None
    sched = decode.engine.scheduler
    assert sched.num_draft_tokens > 0
    assert sched.num_accepted_tokens > 0.8 * sched.num_draft_tokens
    disagg_draft_stack.wait_idle()
