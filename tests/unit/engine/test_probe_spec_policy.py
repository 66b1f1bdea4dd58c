"""tools/probes/probe_spec_policy_gpu.py's CPU smoke run (the H200 table of issue 37 on the tiny
dummy model in bf16): the table has every batch, k and forced rate, every timed sweep step was
the batch at 1 + k rows, every run's tokens follow the chain model, and the engine accepted
first drafts at the forced rate, with the logits rounded as a GPU rounds them (per step shape).
The drafter of c86461f, which replayed a plain run's tokens, measured 2-5% at forced 0.3 and 0.9
under that rounding (1-4% on the H200) and fails this."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.model.llama import LlamaForCausalLM
from gateway.spec_policy import MIN_GAIN
from tools.probes.probe_spec_policy_gpu import GATEWAY_MIN_GAIN, SMOKE, main


def _round_by_step_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise of 0.2 of the logits' spread, drawn per number of rows: a GPU's bf16 kernels
    round a verify step (1 + k rows a sequence) otherwise than a plain step, which flips near
    ties of random weights between the two (the CPU's float kernels do not)."""
    compute = LlamaForCausalLM.compute_logits

    def rounded(self: LlamaForCausalLM, hidden: torch.Tensor, float32: bool = True
                ) -> torch.Tensor:
        logits = compute(self, hidden, float32)
        gen = torch.Generator(device=logits.device).manual_seed(hidden.shape[0])
        noise = torch.randn(logits.shape, generator=gen, device=logits.device)
        spread = logits.float().std(dim=-1, keepdim=True)
        return logits + (0.2 * spread * noise).to(logits.dtype)

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", rounded)


def test_smoke_run_gives_the_table_at_the_forced_acceptance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _round_by_step_shape(monkeypatch)
    out = tmp_path / "spec_policy.json"
    assert main(["--out", str(out), "--smoke"]) == 0
    doc = json.loads(out.read_text())
    cfg = SMOKE
    assert doc["complete"] and doc["chain"]["plain_follows"] and doc["calibration"]["steps"] > 0
    assert [r["batch"] for r in doc["rows"]] == [t["batch"] for t in doc["table"]] \
        == list(cfg.batches)
    ks = [str(k) for k in range(cfg.k + 1)]
    for row in doc["rows"]:
        assert list(row["step_ms_by_k"]) == ks and min(row["step_ms_by_k"].values()) > 0
        assert list(row["cost_model_ms_by_k"]) == ks and min(row["cost_model_ms_by_k"].values()) > 0
        assert "unexpected_rows" not in row, row["unexpected_rows"]
        assert row["off"]["follows_chain"] and row["off"]["draft_tokens"] == 0
        assert [e["forced_rate"] for e in row["by_acceptance"]] == list(cfg.rates)
        for e in row["by_acceptance"]:
            always, policy, pred = e["always"], e["policy"], e["prediction"]
            assert always["follows_chain"] and policy["follows_chain"]
            # Each mode's median run of its repeats stands for it.
            for run in (always, policy):
                assert len(run["tpot_ms_runs"]) == cfg.repeats
                assert run["tpot_ms"] == sorted(run["tpot_ms_runs"])[(cfg.repeats - 1) // 2]
            assert always["draft_tokens"] > (cfg.k - 1) * always["verify_steps"] > 0
            assert 0 <= pred["k"] <= cfg.k and list(pred["per_k"]) == ks
            assert pred["cap_sent"] == (cfg.k if pred["k"] else 0)
            assert min(e["tpot_ms"].values()) > 0 and e["policy_vs_best_fixed"] > 0
    for i, rate in enumerate(cfg.rates):
        runs = [r["by_acceptance"][i]["always"] for r in doc["rows"]]
        steps = sum(x["verify_steps"] for x in runs)
        first = sum(x["accepted_per_pos"][0] * x["verify_steps"] for x in runs) / steps
        # The coins are a hash: binomial noise, 4 sigma.
        assert abs(first - rate) <= 4 * math.sqrt(rate * (1 - rate) / steps) + 0.02, (rate, first)


def test_the_probe_predicts_with_the_gateways_min_gain() -> None:
    assert GATEWAY_MIN_GAIN == MIN_GAIN
