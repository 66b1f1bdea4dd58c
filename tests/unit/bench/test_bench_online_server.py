"""`splitserve bench online` against a running gateway with nothing but the workload's size
given: the model's name from /v1/models, prompts of real tokens from /tokenize, the key from
OPENAI_API_KEY, completions and chat, and the result under `vllm bench serve`'s field names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import cli
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer

API_KEY = "bench-api-key-0123456789"
SIZE = ["--num-prompts", "4", "--input-len", "12", "--output-len", "3"]


@pytest.fixture(scope="module")
def gateway() -> Iterator[Harness]:
    ids = smollm2_tokenizer().encode(" the weather is mild", add_special_tokens=False)
    with Harness(Script(ids, endless=True), api_key=API_KEY) as h:
        yield h


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_online_needs_only_the_server(gateway: Harness, endpoint: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    out = tmp_path / "result.json"
    rc = cli.main(["online", "--base-url", gateway.base_url, "--endpoint", endpoint, *SIZE,
                   "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "4/4" in captured.err  # the progress bar reached the end
    doc = json.loads(out.read_text())
    assert doc["model"] == MODEL_NAME
    m = doc["metrics"]
    assert m["completed"] == 4 and m["failed"] == 0
    for key in ("duration", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
                "p99_itl_ms", "mean_tpot_ms", "mean_e2el_ms", "request_throughput",
                "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests"):
        assert isinstance(m[key], (int, float)), key
    assert m["output_lens"] == [3] * 4 and len(m["ttfts"]) == len(m["itls"]) == 4
    assert all(n > 0 for n in m["input_lens"]) and all(isinstance(i, list) for i in m["itls"])
    assert m["max_output_tokens_per_s"] > 0
    if endpoint == "completions":
        assert m["input_lens"] == [12] * 4  # token ids sent as they are


def test_a_wrong_key_fails_every_request(gateway: Harness, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    rc = cli.main(["online", "--base-url", gateway.base_url, "--api-key", "wrong", *SIZE])
    assert rc == 2 and "401" in capsys.readouterr().err
