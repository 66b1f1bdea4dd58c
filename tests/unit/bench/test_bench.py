"""Tests of the benchmark package: metrics, workloads, the streaming client against a real
local server, results JSON, host refusal, offline record extraction and the H200 summary."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import socket
import statistics
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench import cli, offline
from bench.metrics import (
    MetricsError,
    RequestRecord,
    compute_metrics,
    format_summary,
    parse_goodput,
    parse_percentiles,
)
from bench.online import OnlineSettings, RemoteHostError, SseParser, check_target, run_online
from bench.results import build_result, write_json
from bench.workloads import (
    BenchRequest,
    WorkloadError,
    arrival_gaps,
    arrival_times,
    random_requests,
    shared_prefix_requests,
)
from tools.gpu import h200_suite, merge_suite, summarize_h200

# ---------------------------------------------------------------- metrics


def _records() -> list[RequestRecord]:
    return [
        # ttft 100 ms, e2el 300 ms, tpot (300-100)/3 ms, itl 50/100/50 ms
        RequestRecord(10, 4, 0.0, 0.1, [0.1, 0.15, 0.25, 0.30], 0.30, True),
        # ttft 200 ms, e2el 220 ms, tpot 20 ms, itl 20 ms
        RequestRecord(20, 2, 1.0, 1.2, [1.2, 1.22], 1.22, True),
        # ttft 50 ms, e2el 50 ms, one token: no tpot, no itl
        RequestRecord(5, 1, 2.0, 2.05, [2.05], 2.05, True),
        RequestRecord(7, 0, 3.0, None, [], 3.5, False, "HTTP 500: boom"),
    ]


def _pct(sorted_ms: list[float], p: float) -> float:
    """Linear-interpolated percentile written out by hand (numpy's default method)."""
    rank = p / 100 * (len(sorted_ms) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (rank - lo) * (sorted_ms[hi] - sorted_ms[lo])


def test_metrics_match_hand_computed_values() -> None:
    m = compute_metrics(_records(), duration_s=4.0, percentiles=(50.0, 99.0))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (35, 7)
    assert m.request_throughput == pytest.approx(0.75)
    assert m.output_throughput == pytest.approx(7 / 4)
    assert m.total_token_throughput == pytest.approx(42 / 4)
    assert m.request_goodput is None
    assert m.errors == ["HTTP 500: boom"]

    assert m.ttft.mean_ms == pytest.approx(350 / 3)
    assert m.ttft.median_ms == pytest.approx(100.0)
    assert m.ttft.std_ms == pytest.approx(math.sqrt((16.667**2 + 83.333**2 + 66.667**2) / 3),
                                          rel=1e-3)
    assert m.ttft.percentiles_ms["p99"] == pytest.approx(100 + 0.98 * 100)  # 198
    assert m.tpot.mean_ms == pytest.approx((200 / 3 + 20) / 2)
    assert m.tpot.percentiles_ms["p99"] == pytest.approx(20 + 0.99 * (200 / 3 - 20))
    assert m.itl.mean_ms == pytest.approx(55.0)
    assert m.itl.median_ms == pytest.approx(50.0)
    assert m.itl.percentiles_ms["p99"] == pytest.approx(98.5)
    assert m.itl.percentiles_ms["p50"] == pytest.approx(_pct([20, 50, 50, 100], 50))
    assert m.e2el.mean_ms == pytest.approx(190.0)
    assert m.e2el.median_ms == pytest.approx(220.0)
    assert m.e2el.percentiles_ms["p99"] == pytest.approx(_pct([50, 220, 300], 99))


def test_goodput_counts_requests_meeting_every_slo() -> None:
    # R1 fails tpot (66.7 > 50), R2 fails ttft (200 > 150), R3 (one token: tpot 0) is good.
    m = compute_metrics(_records(), 4.0, goodput_slos_ms=parse_goodput(["ttft:150", "tpot:50"]))
    assert m.request_goodput == pytest.approx(1 / 4)
    m = compute_metrics(_records(), 4.0, goodput_slos_ms={"e2el": 250.0})
    assert m.request_goodput == pytest.approx(2 / 4)


def test_empty_samples_report_zero_and_summary_prints() -> None:
    m = compute_metrics([RequestRecord(3, 1, 0.0, 0.5, [0.5], 0.5, True)], 1.0)
    assert m.tpot.mean_ms == 0.0 and m.itl.percentiles_ms["p99"] == 0.0
    text = format_summary(m)
    assert "Mean TTFT (ms):" in text and "500.00" in text and "P99 ITL (ms):" in text


@pytest.mark.parametrize("spec", [["ttft"], ["foo:1"], ["ttft:abc"], ["tpot:-1"]])
def test_bad_goodput_spec_names_the_flag(spec: list[str]) -> None:
    with pytest.raises(MetricsError, match="--goodput"):
        parse_goodput(spec)


def test_bad_percentiles_and_duration_are_refused() -> None:
    assert parse_percentiles("50,99.9") == (50.0, 99.9)
    with pytest.raises(MetricsError, match="--metric-percentiles"):
        parse_percentiles("0,101")
    with pytest.raises(MetricsError, match="duration_s"):
        compute_metrics(_records(), 0.0)
    m = compute_metrics(_records(), 1.0, percentiles=(99.9,))
    assert "p99.9" in m.ttft.percentiles_ms


# ---------------------------------------------------------------- workloads


def test_random_requests_lengths_vocab_and_seed() -> None:
    reqs = random_requests(20, 16, 5, vocab_size=50, seed=3)
    assert all(r.prompt_len == 16 and r.output_len == 5 for r in reqs)
    assert all(0 <= t < 50 for r in reqs for t in r.prompt_token_ids)
    assert reqs == random_requests(20, 16, 5, vocab_size=50, seed=3)
    assert reqs != random_requests(20, 16, 5, vocab_size=50, seed=4)


def test_random_range_ratio_bounds() -> None:
    reqs = random_requests(400, 100, 10, vocab_size=1000, range_ratio=0.5, seed=0)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150 and len(set(in_lens)) > 20
    assert min(out_lens) >= 5 and max(out_lens) <= 15
    with pytest.raises(WorkloadError, match="random_range_ratio"):
        random_requests(1, 10, 10, 100, range_ratio=1.0)
    with pytest.raises(WorkloadError, match="input_len"):
        random_requests(1, 0, 10, 100)


def test_shared_prefix_groups() -> None:
    reqs = shared_prefix_requests(12, num_groups=3, prefix_len=8, suffix_len=4, output_len=2,
                                  vocab_size=10_000, seed=1)
    assert all(r.prompt_len == 12 and r.output_len == 2 for r in reqs)
    prefixes = [tuple(r.prompt_token_ids[:8]) for r in reqs]
    assert len(set(prefixes)) == 3
    assert all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({tuple(r.prompt_token_ids[8:]) for r in reqs}) == 12
    assert reqs == shared_prefix_requests(12, 3, 8, 4, 2, 10_000, seed=1)


def test_poisson_gaps_mean_rate_and_burstiness() -> None:
    gaps = np.asarray(arrival_gaps(20_000, request_rate=5.0, burstiness=1.0, seed=0))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    smooth = np.asarray(arrival_gaps(20_000, request_rate=5.0, burstiness=4.0, seed=0))
    assert smooth.mean() == pytest.approx(0.2, rel=0.03)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.05)  # gamma: 1/sqrt(k)


def test_arrival_times_inf_normalised_and_invalid() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    times = arrival_times(100, request_rate=10.0, seed=2)
    assert times == sorted(times) and times[-1] == pytest.approx(10.0)
    assert arrival_times(100, 10.0, seed=2) == times
    with pytest.raises(WorkloadError, match="request_rate"):
        arrival_gaps(3, 0.0)
    with pytest.raises(WorkloadError, match="burstiness"):
        arrival_gaps(3, 1.0, burstiness=0.0)


# ---------------------------------------------------------------- SSE + online client


def test_sse_parser_handles_split_events_comments_and_crlf() -> None:
    raw = (b': ping\r\n\r\ndata: {"a": 1}\r\n\r\n'
           b'data: {"b":\ndata: 2}\n\n'
           + 'data: {"t": "é"}\n\ndata: [DONE]\n\n'.encode())
    parser = SseParser()
    got: list[str] = []
    for i in range(0, len(raw), 3):  # 3-byte pieces split lines and a UTF-8 character
        got += parser.feed(raw[i:i + 3])
    assert got == ['{"a": 1}', '{"b":\n2}', '{"t": "é"}', "[DONE]"]


def _chunk(text: str) -> str:
    body = {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return f"data: {json.dumps(body)}\n\n"


def _make_app(received: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        received.append(body)
        if body["max_tokens"] == 99:
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error",
                                           "param": "max_tokens", "code": 400}}, status_code=400)
        stall = body["max_tokens"] == 77

        async def stream() -> AsyncIterator[str]:
            if stall:
                await asyncio.sleep(30)
            n = body["max_tokens"]
            # First chunk carries one token, the second carries two (n = 4: 1 + 2 + 1).
            for text in ("a", "bc", "d")[: max(1, n - 1)]:
                yield _chunk(text)
                await asyncio.sleep(0.01)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_make_app(received), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", received
    srv.should_exit = True
    await task
    sock.close()


async def test_online_client_against_real_server(
        server: tuple[str, list[dict[str, Any]]]) -> None:
    base_url, received = server
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([4, 5], 4)]
    records, duration, model = await run_online(
        OnlineSettings(base_url, max_concurrency=1), requests, [0.0, 0.0])
    assert model == "tiny-model"  # resolved from /v1/models
    assert duration > 0
    body = received[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    for rec, req in zip(records, requests, strict=True):
        assert rec.success, rec.error
        assert rec.output_len == 4  # from usage, though only 3 chunks carried text
        assert rec.prompt_len == req.prompt_len
        assert len(rec.token_times) == 3 and len(rec.itls) == 2
        assert rec.first_token_time == rec.token_times[0] and rec.end_time == rec.token_times[-1]
        assert rec.start_time < rec.token_times[0] <= rec.token_times[1] <= rec.token_times[2]
    m = compute_metrics(records, duration)
    assert m.completed == 2 and m.total_output_tokens == 8 and m.total_input_tokens == 5


async def test_online_client_records_http_errors_and_total_timeout(
        server: tuple[str, list[dict[str, Any]]]) -> None:
    base_url, _ = server
    settings = OnlineSettings(base_url, model="tiny-model", total_timeout_s=0.5)
    records, _, _ = await run_online(
        settings, [BenchRequest([1], 99), BenchRequest([1], 77), BenchRequest([1], 2)],
        [0.0, 0.0, 0.0])
    bad, stalled, good = records
    assert not bad.success and "HTTP 400" in bad.error
    assert not stalled.success and "total timeout" in stalled.error
    assert good.success and good.output_len == 2


# ---------------------------------------------------------------- host refusal


@pytest.mark.parametrize("url", ["http://example.com:8000", "http://10.0.0.5", "http://0.0.0.0:80"])
async def test_non_local_hosts_are_refused(url: str) -> None:
    with pytest.raises(RemoteHostError, match="--allow-remote"):
        check_target(url)
    with pytest.raises(RemoteHostError):
        await run_online(OnlineSettings(url, model="m"), [BenchRequest([1], 1)], [0.0])
    assert check_target(url + "/", allow_remote=True) == url


def test_local_hosts_and_bad_urls() -> None:
    assert check_target("http://localhost:8000/") == "http://localhost:8000"
    assert check_target("http://[::1]:8000") == "http://[::1]:8000"
    with pytest.raises(RemoteHostError, match="http"):
        check_target("ftp://127.0.0.1")


def test_cli_refuses_remote_host_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["online", "--base-url", "http://example.com", "--vocab-size", "10",
                   "--num-prompts", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "example.com" in err and "--allow-remote" in err and "Traceback" not in err


# ---------------------------------------------------------------- results JSON


def test_results_json_fields(tmp_path: Path) -> None:
    doc = build_result("offline", "dummy:tiny", {"num_prompts": 3}, {"completed": 3})
    path = write_json(tmp_path / "sub" / "r.json", doc)
    loaded = json.loads(path.read_text())
    env = loaded["environment"]
    for key in ("commit", "dirty", "hostname", "cpu", "gpu", "torch", "triton", "python"):
        assert key in env
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent, check=True).stdout.strip()
    assert env["commit"] == head and isinstance(env["dirty"], bool)
    assert loaded["benchmark"] == "offline" and loaded["model"] == "dummy:tiny"
    assert loaded["settings"] == {"num_prompts": 3} and loaded["metrics"] == {"completed": 3}
    assert loaded["timestamp"].endswith("+00:00")
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_git_info_without_history_uses_env(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.results import git_info

    monkeypatch.setenv("SPLITSERVE_COMMIT", "abc123")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_info(tmp_path) == {"commit": "abc123", "dirty": None}


# ---------------------------------------------------------------- offline records


def _engine_output(n_tokens: int, t0: float, with_metrics: bool = True) -> SimpleNamespace:
    times = [t0 + 0.5 + 0.1 * k for k in range(n_tokens)]
    metrics = SimpleNamespace(arrival_time=t0, first_token_time=times[0],
                              finished_time=times[-1], token_times=times)
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n_tokens)))],
                           metrics=metrics if with_metrics else None)


def test_offline_records_from_engine_outputs() -> None:
    req = BenchRequest([1, 2, 3], 4)
    rec = offline.record_from_output(_engine_output(4, 10.0), req, 0)
    assert (rec.prompt_len, rec.output_len) == (3, 4)
    assert rec.ttft == pytest.approx(0.5) and rec.e2el == pytest.approx(0.8)
    assert rec.itls == pytest.approx([0.1, 0.1, 0.1])
    with pytest.raises(offline.OfflineBenchError, match=r"metrics\.first_token_time"):
        offline.record_from_output(_engine_output(4, 0.0, with_metrics=False), req, 7)


def test_step_itls_median_per_step() -> None:
    a = RequestRecord(1, 3, 0.0, 1.0, [1.0, 1.1, 1.3], 1.3, True)
    b = RequestRecord(1, 3, 0.0, 1.0, [1.0, 1.2, 1.5], 1.5, True)
    c = RequestRecord(1, 3, 0.0, 1.0, [1.0, 1.3, 1.4], 1.4, True)
    gaps, source = offline.step_itls([a, b, c])
    assert source == "token_times"
    assert gaps == pytest.approx([statistics.median([0.1, 0.2, 0.3]),
                                  statistics.median([0.2, 0.3, 0.1])])
    only_first = RequestRecord(1, 3, 0.0, 1.0, [1.0], 1.4, True)
    assert offline.step_itls([only_first]) == ([pytest.approx(0.2)], "tpot")


class _FakeLLM:
    """A stand-in engine (the dependency, not the code under test): one token per 1 ms step."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def generate(self, prompts: list[dict[str, list[int]]], params: Any) -> list[SimpleNamespace]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        t0 = time.perf_counter()
        return [_engine_output(p.max_tokens, t0) for p in params_list]


def test_cli_offline_throughput_and_latency_write_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from engine_api.sampling_params import SamplingParams

    monkeypatch.setattr(offline, "_engine_attr",
                        {"LLM": _FakeLLM, "SamplingParams": SamplingParams}.__getitem__)
    out = tmp_path / "offline.json"
    rc = cli.main(["offline", "--model", "dummy:tiny", "--num-prompts", "5", "--input-len", "8",
                   "--output-len", "3", "--goodput", "ttft:1000", "--out", str(out)])
    assert rc == 0
    assert "Output token throughput (tok/s):" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["metrics"]["completed"] == 5 and doc["metrics"]["total_output_tokens"] == 15
    assert doc["metrics"]["total_input_tokens"] == 40
    assert doc["metrics"]["itl"]["mean_ms"] == pytest.approx(100.0)
    assert doc["settings"]["goodput"] == ["ttft:1000"] and doc["model"] == "dummy:tiny"
    rc = cli.main(["offline", "--mode", "latency", "--batch-size", "4", "--model", "dummy:tiny",
                   "--input-len", "8", "--output-len", "5", "--out", str(out)])
    assert rc == 0
    lat = json.loads(out.read_text())["metrics"]
    assert lat["median_itl_ms"] == pytest.approx(100.0) and lat["itl_source"] == "token_times"
    assert lat["batch_size"] == 4


def test_cli_offline_embed_on_the_real_engine(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--mode embed` runs LLM.embed on the tiny dummy model (CPU) and reports its rates."""
    from engine.loader.presets import PRESETS

    out = tmp_path / "embed.json"
    rc = cli.main(["offline", "--mode", "embed", "--model", "dummy:tiny", "--dtype", "float32",
                   "--num-prompts", "6", "--input-len", "9", "--out", str(out)])
    assert rc == 0
    assert "input_token_throughput:" in capsys.readouterr().out
    result = json.loads(out.read_text())["metrics"]
    assert (result["completed"], result["total_input_tokens"]) == (6, 54)
    assert result["embedding_dim"] == PRESETS["tiny"]["hidden_size"]
    assert result["request_throughput"] * result["duration_s"] == pytest.approx(6)
    assert result["input_token_throughput"] == pytest.approx(
        result["request_throughput"] * 9)


# ---------------------------------------------------------------- H200 suite helpers


def test_summary_headline_and_gaps(tmp_path: Path) -> None:
    suite = {"steps": {
        "latency_graphs": {"ok": True, "result": {"bs1": {"median_itl_ms": 5.0}}},
        "latency_eager": {"ok": True, "result": {"bs1": {"median_itl_ms": 20.0}}},
        "ttft_4096": {"ok": False, "error": "StepTimeout: too slow"},
        "concurrent_128": {"ok": True, "result": {"output_throughput": 3000.0}},
        "hf_baseline_128": {"ok": True, "result": {"output_tok_s": 1000.0}},
    }}
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    assert summarize_h200.main(["--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "h200_llama-3.1-8b.json").read_text())
    for key in ("commit", "itl_ms_bs1", "itl_ms_bs1_eager", "output_tok_s_random_1000x1000",
                "ttft_ms_4096", "output_tok_s_128x512x128", "hf_output_tok_s_128x512x128",
                "goals", "gaps"):
        assert key in doc
    assert doc["itl_ms_bs1"] == 5.0 and doc["ttft_ms_4096"] is None
    assert doc["gaps"]["itl_ms_bs1"]["met"] is False  # goal 4.4 ms
    assert doc["gaps"]["itl_ms_bs1"]["gap"] == pytest.approx(5.0 - 4.4)
    assert doc["gaps"]["itl_ms_bs1_eager"]["gap"] == pytest.approx(20.0 - 14.4)
    assert doc["gaps"]["output_tok_s_128x512x128"]["met"] is True  # beats 1,231 tok/s
    assert doc["gaps"]["output_tok_s_128x512x128"]["gap"] == pytest.approx(1231.0 - 3000.0)
    assert doc["engine_vs_hf_128x512x128"] == pytest.approx(3.0)
    assert doc["failed_steps"] == {"ttft_4096": "StepTimeout: too slow"}


def test_merged_parts_summarise_like_the_committed_headline(tmp_path: Path) -> None:
    """The committed headline was merged from two parts (a24e667's by hand); split its suite
    into those parts again, and merge_suite gives back every step and the headline's numbers."""
    results = Path(__file__).resolve().parents[3] / "bench" / "results"
    committed = json.loads((results / "h200_llama-3.1-8b.json").read_text())
    suite = json.loads((results / "h200" / f"suite_{committed['commit']}.json").read_text())
    part_b = {"throughput_random_fp8", "throughput_random_int8", "throughput_random_w8a8_fp8"}
    paths = []
    for label, names in (("A", set(suite["steps"]) - part_b), ("B", part_b)):
        part = {"environment": suite["environment"], "sizes": suite["sizes"],
                "steps": {n: e for n, e in suite["steps"].items() if n in names}}
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(part))
        paths.append(f"part {label}={path}")
    out = tmp_path / "merged"
    assert merge_suite.main(["--out-dir", str(out), *paths]) == 0
    merged = json.loads((out / "suite.json").read_text())
    assert merged["steps"] == suite["steps"] and list(merged["parts"]) == ["part A", "part B"]
    doc = json.loads((out / "h200_llama-3.1-8b.json").read_text())
    assert doc["commit"] == committed["commit"] and doc["failed_steps"] == {}
    for key in summarize_h200.headline(suite):
        assert doc[key] == committed[key], key


def test_merge_refuses_parts_of_different_runs() -> None:
    env = {"commit": "abc", "hostname": "vm", "gpu": "NVIDIA H200", "torch": "2.11.0",
           "triton": "3.6.0"}

    def part(steps: list[str], **changes: Any) -> dict[str, Any]:
        return {"environment": {**env, **changes.pop("env", {})},
                "sizes": {"max_num_seqs": 384, **changes.pop("sizes", {})},
                "steps": {n: {"ok": True, "result": {}} for n in steps}}

    assert set(merge_suite.merge([("a", part(["x"])), ("b", part(["y"]))])["steps"]) == {"x", "y"}
    bad = {
        "commit differs": [("a", part(["x"])), ("b", part(["y"], env={"commit": "def"}))],
        "gpu differs": [("a", part(["x"])), ("b", part(["y"], env={"gpu": "NVIDIA H100"}))],
        "sizes differ": [("a", part(["x"])), ("b", part(["y"], sizes={"max_num_seqs": 768}))],
        "is in 'a' and in 'b'": [("a", part(["x"])), ("b", part(["x"]))],
        "labels must differ": [("a", part(["x"])), ("a", part(["y"]))],
        "at least two": [("a", part(["x"]))],
        "not a suite file": [("a", part(["x"])), ("b", {"steps": {}})],
    }
    for message, parts in bad.items():
        with pytest.raises(merge_suite.MergeError, match=message):
            merge_suite.merge(parts)


def test_suite_builds_the_one_byte_kv_engines_at_their_own_batch() -> None:
    """The fp8- and int8-KV throughput steps' engines take `fp8_kv_max_num_seqs` sequences and
    capture graphs up to that batch; the bf16 engines keep `max_num_seqs` and the graph cap as
    given."""
    sizes = dataclasses.replace(h200_suite.SuiteSizes.small("dummy:tiny"), max_num_seqs=4,
                                fp8_kv_max_num_seqs=12, cuda_graph_max_batch=8)
    holder = h200_suite.EngineHolder(sizes)
    try:
        config = holder.get(enforce_eager=True, kv_cache_dtype="fp8").engine.config
        assert config.scheduler.max_num_seqs == 12 and config.runner.cuda_graph_max_batch == 12
        assert config.cache.kv_cache_dtype == "fp8"
        config = holder.get(enforce_eager=True, kv_cache_dtype="int8").engine.config
        assert config.scheduler.max_num_seqs == 12 and config.runner.cuda_graph_max_batch == 12
        assert config.cache.kv_cache_dtype == "int8"
        assert config.runner.quantization == "none" and holder.quantization == "none"
        # The W8A8 step's engine: fp8 weights beside the fp8 cache, at the one-byte batch.
        config = holder.get(enforce_eager=True, kv_cache_dtype="fp8",
                            quantization="fp8").engine.config
        assert config.scheduler.max_num_seqs == 12 and config.runner.quantization == "fp8"
        assert holder.quantization == "fp8"
        config = holder.get(enforce_eager=True).engine.config
        assert config.scheduler.max_num_seqs == 4 and config.runner.cuda_graph_max_batch == 8
        assert config.runner.quantization == "none"
    finally:
        holder.release()


def test_step_deadline_interrupts_a_stuck_step() -> None:
    with pytest.raises(h200_suite.StepTimeout), h200_suite.deadline(0.05):
        time.sleep(5)


def test_hf_baseline_tiny_on_cpu() -> None:
    from bench.hf_baseline import build_model, run_generate

    hf = build_model("dummy:llama-3.1-8b", "cpu", "float32", overrides={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
        "bos_token_id": 1})
    result = run_generate(hf, batch_size=2, input_len=5, output_len=3)
    assert (result.batch_size, result.input_len, result.output_len) == (2, 5, 3)
    assert result.output_tok_s > 0 and result.dtype == "float32"
    assert result.decode_step_ms is not None


def test_probe_kernel_totals_and_ttft_split() -> None:
    from tools.probes.probe_ttft import _analyse
    from tools.profiling import rank_by_name

    assert rank_by_name([("x", 1.0), ("y", 3.0), ("x", 1.5)], rows=2) == [
        {"name": "y", "calls": 1, "ms": 3.0}, {"name": "x", "calls": 2, "ms": 2.5}]
    # Kernels in µs: a and b overlap (busy 10-30), a 10 µs gap, then c and d back to back.
    split = _analyse([(40, 50, "c"), (10, 20, "a"), (15, 30, "b"), (50, 60, "d")],
                     wall_us=100, t0_us=0)
    assert split["host_before_first_kernel_ms"] == pytest.approx(0.010)
    assert split["kernel_busy_ms"] == pytest.approx(0.040)
    assert split["idle_gaps_ms"] == pytest.approx(0.010) and split["idle_gaps"] == 1
    assert split["largest_gaps"][0] == {"us": 10, "after": "b", "before": "c"}
    assert split["after_last_kernel_ms"] == pytest.approx(0.040)


def test_gc_pauses_counts_collections() -> None:
    import gc

    from tools.profiling import GcPauses

    with GcPauses() as pauses:
        gc.collect()
    summary = pauses.summary()
    assert summary["collections"][2] >= 1 and summary["total_ms"] >= 0


def test_cli_offline_with_speculative_decoding_reports_its_counters(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real engine (SmolLM2 on the CPU) through `splitserve bench offline`: the
    speculative config reaches it and the result carries the draft counters."""
    out = tmp_path / "spec.json"
    rc = cli.main(["offline", "--model", "", "--dtype", "float32", "--num-prompts", "2",
                   "--input-len", "24", "--output-len", "12", "--max-num-seqs", "2",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                   "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    metrics = doc["metrics"]
    assert metrics["completed"] == 2 and metrics["total_output_tokens"] == 24
    assert metrics["spec_decode_num_accepted_tokens"] <= metrics["spec_decode_num_draft_tokens"]
    assert doc["settings"]["speculative_config"]["method"] == "ngram"
    assert "spec_decode_num_draft_tokens:" in capsys.readouterr().out


def test_cli_rejects_a_speculative_config_that_is_not_a_json_object() -> None:
    with pytest.raises(SystemExit):
        cli.main(["offline", "--speculative-config", "[1, 2]"])


def test_synthetic_tokenizer_decodes_every_id_of_the_model(tmp_path: Path) -> None:
    """The tokenizer written for dummy weights: each id in [0, vocab) is one distinct token,
    the special tokens sit at Llama 3's ids, and the engine's tokenizer and incremental
    detokenizer decode generated ids to the text of their tokens."""
    from engine_api.detokenizer import IncrementalDetokenizer
    from engine_api.tokenizer import Tokenizer
    from tools import synthetic_tokenizer

    vocab = synthetic_tokenizer.build_vocab(128256, seed=3)
    assert sorted(vocab.values()) == list(range(128256))
    assert vocab["<|begin_of_text|>"] == 128000 and vocab["<|eot_id|>"] == 128009
    small = synthetic_tokenizer.build_vocab(300)
    assert sorted(small.values()) == list(range(300)) and small["<|eot_id|>"] == 299
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic_tokenizer.build_vocab(100)

    tok = Tokenizer.from_file(str(synthetic_tokenizer.write(tmp_path, 128256, seed=3)))
    assert tok.eos_token_ids == (128009,) and tok.bos_token_id == 128000
    text_of = {i: t for t, i in vocab.items()}
    ids = [300, 128255, 77777, 5000]
    expected = "".join(text_of[i] for i in ids).replace("Ġ", " ")
    assert tok.decode(ids) == expected
    detok = IncrementalDetokenizer(tok, [1, 2], skip_special_tokens=True, stop=[],
                                   include_stop_str_in_output=False)
    streamed = "".join(detok.add_tokens([i]).text_delta for i in ids) + detok.finish().text_delta
    assert streamed == expected


def test_probe_accuracy_compares_variants_with_the_reference(tmp_path: Path) -> None:
    """tools/probes/probe_accuracy.py: a variant configured as the reference is the reference (top-1
    1.0, zero error and KL); an int8 KV cache moves the logits a little; a pair compares two
    variants' own logits (int8 against the reference's twin gives int8's own figures)."""
    from tools.probes import probe_accuracy

    out = tmp_path / "acc.json"
    assert probe_accuracy.main([
        "--out", str(out), "--model", "dummy:tiny", "--max-tokens", "4", "--max-model-len",
        "600", "--reference", "attention_backend=torch",
        "--variant", "same:attention_backend=torch", "--variant", "int8:kv_cache_dtype=int8",
        "--pair", "int8/same"]) == 0
    doc = json.loads(out.read_text())
    same, int8 = doc["variants"]["same"], doc["variants"]["int8"]
    assert doc["positions"] == 8 * 4 and doc["reference_self_agreement"] == 1.0
    assert same["top1_agreement"] == 1.0 and same["rel_l2_logits_max"] == 0.0
    assert same["kl_max"] == pytest.approx(0.0, abs=1e-9)
    assert 0.0 < int8["rel_l2_logits_mean"] < 0.5 and int8["k_scale_range"][0] > 0
    assert doc["pairs"]["int8/same"]["rel_l2_logits_mean"] == pytest.approx(
        int8["rel_l2_logits_mean"])
    with pytest.raises(SystemExit):
        probe_accuracy.main(["--out", str(out), "--variant", "bad:kv_cache_dtype=fp4"])


def test_requests_pick_lora_adapters_at_random_and_name_them_as_the_model() -> None:
    from bench.online import build_payload
    from bench.workloads import assign_adapters

    requests = [BenchRequest([1, 2], 3) for _ in range(200)]
    assert assign_adapters(requests, []) is requests
    picked = assign_adapters(requests, ["a", "b"], seed=3)
    assert picked == assign_adapters(requests, ["a", "b"], seed=3)  # seeded
    counts = {n: sum(r.lora_name == n for r in picked) for n in ("a", "b")}
    assert counts["a"] + counts["b"] == 200 and min(counts.values()) > 60
    assert build_payload("base", picked[0])["model"] == picked[0].lora_name
    assert build_payload("base", requests[0])["model"] == "base"


def test_cli_offline_lora_modules_reach_the_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_api.sampling_params import SamplingParams

    seen: dict[str, Any] = {}

    class _LoRAFake(_FakeLLM):
        def generate(self, prompts: list[dict[str, list[int]]], params: Any,
                     lora_request: Any = None) -> list[SimpleNamespace]:
            seen["kwargs"], seen["lora"] = self.kwargs, lora_request
            return super().generate(prompts, params)

    monkeypatch.setattr(offline, "_engine_attr",
                        {"LLM": _LoRAFake, "SamplingParams": SamplingParams}.__getitem__)
    rc = cli.main(["offline", "--model", "dummy:tiny", "--num-prompts", "6", "--input-len", "4",
                   "--output-len", "2", "--lora-modules", "x=/a", "y=/b",
                   "--out", str(tmp_path / "o.json")])
    assert rc == 0
    assert seen["kwargs"]["lora_modules"] == {"x": "/a", "y": "/b"}
    assert len(seen["lora"]) == 6 and set(seen["lora"]) <= {"x", "y"}
