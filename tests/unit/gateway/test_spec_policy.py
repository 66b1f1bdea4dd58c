"""The gateway's speculative decoding policy (gateway/spec_policy.py): the choice for a load, its
settings and flags, and what reaches a decode worker. Fake workers here (tests/support/gateway_fakes.py:
real gRPC servers that record each DecodeRequest and report a chosen load); the real engine
behind a real worker is in tests/e2e/test_e2e_spec.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import pytest

from engine.cli_args import engine_config_from_args
from engine.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from gateway.config import GatewayConfig, GatewayConfigError
from gateway.router import WorkerPool
from gateway.server import build_parser as gateway_parser
from gateway.server import config_from_args
from gateway.spec_policy import (
    decide,
    method_for_load,
    speculative_tokens_for_load,
    worker_load,
)
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from splitserve.serve import build_serve_parser
from splitserve.up import build_parser as up_parser
from splitserve.up import service_argv
from tests.support.gateway_fakes import Harness, Script, smollm2_tokenizer

DECODE = ("127.0.0.1:50062",)


# -- the policy function ---------------------------------------------------------------------
@pytest.mark.parametrize(("load", "expected"), [(0, 4), (3, 4), (4, 0), (5, 0), (100, 0)])
def test_drafts_below_the_threshold_off_at_and_above(load: int, expected: int) -> None:
    assert speculative_tokens_for_load(load, speculative_tokens=4, max_load=4) == expected


@pytest.mark.parametrize("load", [0, 1, 10])
def test_zero_speculative_tokens_is_always_off(load: int) -> None:
    assert speculative_tokens_for_load(load, speculative_tokens=0, max_load=4) == 0


def test_max_load_one_speculates_only_on_an_idle_worker() -> None:
    assert speculative_tokens_for_load(0, speculative_tokens=7, max_load=1) == 7
    assert speculative_tokens_for_load(1, speculative_tokens=7, max_load=1) == 0


def test_decision_reads_the_load_the_router_picked_on() -> None:
    """running + waiting from the last report + picks since, less the request being routed."""
    async def run() -> list[tuple[int, int]]:
        pool = WorkerPool("decode", list(DECODE))
        try:
            w = pool.workers[0]
            w.healthy = w.reported = True
            w.load = common_pb2.LoadReport(num_running=1, num_waiting=1)
            config = GatewayConfig(decode_addresses=DECODE, colocated=True,
                                   speculative_tokens=3, speculative_max_load=4)
            seen = []
            for _ in range(4):
                picked = pool.pick()
                d = decide(picked, config)
                assert d.load == worker_load(picked)
                assert d.enabled == (d.num_speculative_tokens > 0)
                seen.append((d.load, d.num_speculative_tokens))
            return seen
        finally:
            await pool.close()

    # 2 in the report; each earlier pick adds one: 2, 3 below 4; 4, 5 not.
    assert asyncio.run(run()) == [(2, 3), (3, 3), (4, 0), (5, 0)]


NGRAM, DRAFT = common_pb2.SPECULATIVE_METHOD_NGRAM, common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL
DEFAULT = common_pb2.SPECULATIVE_METHOD_UNSPECIFIED


@pytest.mark.parametrize(("load", "methods", "want"), [
    (0, [DRAFT, NGRAM], DRAFT), (1, [DRAFT, NGRAM], DRAFT),   # below draft_max_load=2
    (2, [DRAFT, NGRAM], NGRAM), (5, [DRAFT, NGRAM], NGRAM),  # n-gram from there on
    (0, [NGRAM], NGRAM),                                     # a worker without a draft model
    (0, [DRAFT], DRAFT), (3, [DRAFT], DEFAULT),              # only a draft model: its own
    (0, [], DEFAULT),                                        # not reported: the worker's own
])
def test_the_proposer_follows_the_load_and_what_the_worker_has(
        load: int, methods: list[int], want: int) -> None:
    assert method_for_load(load, methods, draft_max_load=2) == want  # type: ignore[arg-type]


def test_decision_labels_and_the_method_only_when_drafting() -> None:
    async def run() -> list[tuple[int, str, int]]:
        pool = WorkerPool("decode", list(DECODE))
        try:
            w = pool.workers[0]
            w.healthy = w.reported = True
            w.load = common_pb2.LoadReport(speculative_methods=[DRAFT, NGRAM])
            config = GatewayConfig(decode_addresses=DECODE, colocated=True, speculative_tokens=3,
                                   speculative_max_load=3, speculative_draft_max_load=1)
            out = []
            for _ in range(4):
                d = decide(pool.pick(), config)
                out.append((d.num_speculative_tokens, d.label, int(d.method)))
            return out
        finally:
            await pool.close()

    assert asyncio.run(run()) == [(3, "draft_model", DRAFT), (3, "ngram", NGRAM),
                                  (3, "ngram", NGRAM), (0, "off", DEFAULT)]


# -- settings and flags ----------------------------------------------------------------------
def test_config_defaults_and_bounds() -> None:
    base = GatewayConfig(decode_addresses=DECODE, colocated=True)
    assert (base.speculative_tokens, base.speculative_max_load) == (4, 4)
    for ok in (0, 1, MAX_SPECULATIVE_TOKENS):
        assert base.replace(speculative_tokens=ok).speculative_tokens == ok
    assert base.replace(speculative_max_load=1).speculative_max_load == 1


@pytest.mark.parametrize(("field", "value"), [
    ("speculative_tokens", -1), ("speculative_tokens", MAX_SPECULATIVE_TOKENS + 1),
    ("speculative_tokens", 2.5), ("speculative_tokens", True), ("speculative_tokens", "4"),
    ("speculative_max_load", 0), ("speculative_max_load", -3), ("speculative_max_load", 1.5),
    ("max_concurrent_requests", -1), ("max_concurrent_requests", 1.5),
    ("max_concurrent_requests", True), ("max_concurrent_requests", "8"),
])
def test_config_refuses_bad_values(field: str, value: object) -> None:
    with pytest.raises(GatewayConfigError, match=field):
        GatewayConfig(decode_addresses=DECODE, colocated=True, **{field: value})  # type: ignore[arg-type]


def test_gateway_flags() -> None:
    base = ["--decode", DECODE[0], "--colocated"]
    config = config_from_args(gateway_parser().parse_args(base))
    assert (config.speculative_tokens, config.speculative_max_load) == (4, 4)
    config = config_from_args(gateway_parser().parse_args(
        [*base, "--speculative-tokens", "0", "--speculative-max-load", "9"]))
    assert (config.speculative_tokens, config.speculative_max_load) == (0, 9)
    with pytest.raises(GatewayConfigError, match="speculative_tokens"):
        config_from_args(gateway_parser().parse_args([*base, "--speculative-tokens", "99"]))


def test_max_concurrent_requests_setting_and_flag() -> None:
    """The gateway's bound on requests in flight: 0 (none) by default, any integer >= 0."""
    base = ["--decode", DECODE[0], "--colocated"]
    assert config_from_args(gateway_parser().parse_args(base)).max_concurrent_requests == 0
    config = config_from_args(gateway_parser().parse_args(
        [*base, "--max-concurrent-requests", "64"]))
    assert config.max_concurrent_requests == 64
    assert config.replace(max_concurrent_requests=0).max_concurrent_requests == 0
    with pytest.raises(GatewayConfigError, match="max_concurrent_requests must be an integer >= 0"):
        config_from_args(gateway_parser().parse_args([*base, "--max-concurrent-requests", "-2"]))


def _up(argv: Sequence[str]) -> dict[str, list[str]]:
    args, engine_args = up_parser().parse_known_args(list(argv))
    return service_argv(args, engine_args)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_up_passes_speculation_to_the_decode_worker_and_the_gateway() -> None:
    plain = _up([])
    assert "--speculative-tokens" not in plain["gateway"]  # the gateway's own default
    assert "--speculative-max-load" not in plain["gateway"]
    argv = _up(["--speculative-method", "ngram", "--num-speculative-tokens", "3"])
    # The decode worker's engine gets the flags (a prefill engine never speculates).
    decode_args = build_serve_parser().parse_args(argv["decode"])
    assert engine_config_from_args(decode_args, role="decode").speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3)
    # The gateway asks for the worker's own number of drafts.
    assert _flag(argv["gateway"], "--speculative-tokens") == "3"
    argv = _up(["--speculative-method=ngram", "--speculative-tokens", "2",
                "--speculative-max-load", "6"])
    assert (_flag(argv["gateway"], "--speculative-tokens"),
            _flag(argv["gateway"], "--speculative-max-load")) == ("2", "6")
    gw = config_from_args(gateway_parser().parse_args(argv["gateway"][2:]))  # after --role gateway
    assert (gw.speculative_tokens, gw.speculative_max_load) == (2, 6)


def test_colocated_serve_flags() -> None:
    args = build_serve_parser().parse_args(["--role", "colocated", "--speculative-method",
                                            "ngram", "--speculative-max-load", "2"])
    assert engine_config_from_args(args).speculative.method == "ngram"
    assert args.speculative_max_load == 2
    default = build_serve_parser().parse_args(["--role", "colocated"])
    assert engine_config_from_args(default).speculative.method == "none"  # off by default
    assert default.speculative_max_load == GatewayConfig(
        decode_addresses=DECODE, colocated=True).speculative_max_load


# -- through a gateway to (fake) decode workers -----------------------------------------------
def _generate(h: Harness, max_tokens: int = 3) -> None:
    with grpc.insecure_channel(h.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        out = list(stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3]),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens)), timeout=20))
    assert out[-1].WhichOneof("response") == "complete"


def _decisions(h: Harness) -> dict[str, float]:
    assert h.gateway is not None and h.gateway.state is not None
    registry = h.gateway.state.metrics.registry
    return {label: registry.get_sample_value("splitserve:spec_decode_decisions_total",
                                             {"speculation": label}) or 0.0
            for label in ("draft_model", "ngram", "default", "off")}


def _wait_polled(h: Harness, num_running: int) -> None:
    """Until the gateway's router has seen the decode worker's new load (polls every 0.2 s)."""
    assert h.gateway is not None and h.gateway.state is not None
    worker = h.gateway.state.router.decode.workers[0]
    deadline = time.monotonic() + 10
    while (worker.load.num_running != num_running
           or worker.in_flight != worker.in_flight_at_poll):
        assert time.monotonic() < deadline, "the router never polled the new load"
        time.sleep(0.02)


def test_every_decode_call_carries_the_policy_for_the_workers_load() -> None:
    ids = smollm2_tokenizer().encode(" one two three four", add_special_tokens=False)
    with Harness(Script(ids), speculative_tokens=5, speculative_max_load=3) as h:
        dec = h.decode[0]
        _wait_polled(h, 0)
        _generate(h)
        dec.num_running = 3            # at the threshold: off
        _wait_polled(h, 3)
        _generate(h)
        dec.num_running = 2            # below it again
        _wait_polled(h, 2)
        _generate(h)
        sent = [r.num_speculative_tokens for r in dec.decode_requests]
        assert all(r.HasField("num_speculative_tokens") for r in dec.decode_requests)
        assert sent == [5, 0, 5]
        assert _decisions(h) == {"draft_model": 0.0, "ngram": 0.0, "default": 2.0, "off": 1.0}
        # The fake reports no methods: the worker's own (UNSPECIFIED), and none when off.
        assert [r.speculative_method for r in dec.decode_requests] == [DEFAULT] * 3
        # Not fixed: the worker's step budget may lower them.
        assert not any(r.speculative_fixed for r in dec.decode_requests)


def test_always_sends_fixed_drafts() -> None:
    """The "always" policy: its drafts at any load, which the worker must not lower."""
    ids = smollm2_tokenizer().encode(" one two", add_special_tokens=False)
    with Harness(Script(ids), speculative_tokens=3, speculative_policy="always") as h:
        h.decode[0].num_running = 100
        _generate(h)
        (request,) = h.decode[0].decode_requests
        assert request.num_speculative_tokens == 3 and request.speculative_fixed


def test_zero_speculative_tokens_sends_an_explicit_zero() -> None:
    ids = smollm2_tokenizer().encode(" one two", add_special_tokens=False)
    with Harness(Script(ids), speculative_tokens=0) as h:
        _generate(h)
        (request,) = h.decode[0].decode_requests
        # Present and 0, not absent (which would mean the worker's default).
        assert request.HasField("num_speculative_tokens") and request.num_speculative_tokens == 0
        assert _decisions(h) == {"draft_model": 0.0, "ngram": 0.0, "default": 0.0, "off": 1.0}


def test_a_resume_decides_again_for_the_new_worker() -> None:
    ids = smollm2_tokenizer().encode(" one two three four five six", add_special_tokens=False)
    with Harness(Script(ids, die_after=2), num_decode=2, speculative_tokens=2,
                 speculative_max_load=1) as h:
        busy = max(h.decode, key=lambda w: w.address)
        busy.num_running = 1          # picked second (more load), where speculation is off
        assert h.gateway is not None and h.gateway.state is not None
        deadline = time.monotonic() + 10
        while any(not w.reported for w in h.gateway.state.router.decode.workers) or max(
                w.load.num_running for w in h.gateway.state.router.decode.workers) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _generate(h, max_tokens=6)
        idle = next(w for w in h.decode if w is not busy)
        assert [r.num_speculative_tokens for r in idle.decode_requests] == [2]
        assert [r.num_speculative_tokens for r in busy.decode_requests] == [0]
        assert len(busy.decode_requests[0].output_token_ids) > len(
            idle.decode_requests[0].output_token_ids)  # the resume came second


def test_gateway_limit_is_the_engines() -> None:
    from gateway import config as gateway_config

    assert gateway_config.MAX_SPECULATIVE_TOKENS == MAX_SPECULATIVE_TOKENS
