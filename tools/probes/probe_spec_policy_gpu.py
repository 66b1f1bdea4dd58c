"""The speculative decoding policy's verify-cost side on one engine (the H200 table of issue
37): the worker's measured cost model, the gain it predicts at a known acceptance, the k the
policy picks from them, and the TPOT measured with the policy on, off and always on, for each
batch size.

One engine (default: dummy Llama-3.1-8B, random weights, no tokenizer) with n-gram speculation
(k drafts at most). In order:

1. start-up calibration as a decode worker runs it (`LLMEngine.calibrate_speculation`), timed;
2. the cost sweep: for each batch b and k in 0..K, a few decode steps of b sequences with k
   drafts each that are never right (their acceptance does not change a step's rows): the
   measured ms per step, and the worker's cost model (`engine.spec_cost`, which those steps
   and every later one refine) at the same rows;
3. per batch b and forced acceptance a (`--acceptance`): `off` (k = 0: the reference tokens
   and TPOT), `always` (K drafts per step, the worker's step budget off and no pausing) with a
   drafter that drafts the reference's next tokens, each right with probability a
   (`ForcedAcceptance`: acceptance at position i is about a^(i+1)), which the engine measures
   per position; then the policy's prediction from the measured cost and acceptance
   (engine_api/spec_gain.py `best_k`, the gateway's rule for a batch of b alike sequences:
   predicted gain and step time for every k), and `policy`: as the gateway sends it (no SLO),
   the request's cap is K when the predicted best k is above 0 (else 0), and the worker's step
   budget and pausing pick each step's drafts, as a worker runs it.

TPOT is per request (first to last token), the median over the batch. Greedy sampling; a run
whose tokens part from the reference (bf16 near-ties in verify steps with random weights)
gets lower acceptance, which is measured, not assumed.

Usage (H200):
  PYTHONPATH=. python3 tools/probes/probe_spec_policy_gpu.py --out F
CPU smoke run:
  PYTHONPATH=. python3 tools/probes/probe_spec_policy_gpu.py --out F --model dummy:tiny \
      --device cpu --dtype float32 --batches 1,2,4 --input-len 32 --output-len 16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from bench.results import git_info
from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.spec import SequenceProposer
from engine_api.request_options import RequestOptions
from engine_api.spec_gain import best_k

METHOD = "ngram"  # the proposer slot the synthetic drafters take
COST_STEPS = 4    # timed decode steps per (batch, k) point of the sweep


class WrongDrafts(SequenceProposer):
    """k drafts that greedy decoding never picks (the verify step's cost alone)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [(token_ids[-1] + 7 * (j + 1)) % self.vocab for j in range(k)]


class ForcedAcceptance(SequenceProposer):
    """Drafts a reference run's next tokens, each right with probability `rate` (a wrong one
    is the reference token + 1), so a verify step accepts position i with probability about
    rate^(i+1). Seeded by the position: the same sequence gets the same drafts."""

    def __init__(self, references: Sequence[list[int]], rate: float, vocab: int) -> None:
        self.by_prefix = {tuple(seq[:16]): seq for seq in references}
        self.rate = rate
        self.vocab = vocab

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        ref = self.by_prefix.get(tuple(token_ids[:16]))
        if ref is None:
            return []
        n = len(token_ids)
        rng = random.Random(n * 1_000_003 + ref[0])
        want = ref[n:n + k]
        return [t if rng.random() < self.rate else (t + 1) % self.vocab for t in want]


@contextlib.contextmanager
def spec_settings(engine: LLMEngine, budget: bool, min_accepted: float | None) -> Iterator[None]:
    """The worker's step budget on or off and the pause floor, for one run."""
    saved = engine.config, engine.spec_budget
    spec = engine.config.speculative
    if min_accepted is not None:
        engine.config = dataclasses.replace(
            engine.config, speculative=dataclasses.replace(spec, min_accepted_per_step=min_accepted))
    if not budget:
        engine.spec_budget = None
    try:
        yield
    finally:
        engine.config, engine.spec_budget = saved


def _options(max_tokens: int, k: int, cls: str) -> RequestOptions:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return RequestOptions(params, num_speculative_tokens=k, speculative_method=METHOD,
                          speculative_class=cls)


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, k: int, cls: str,
              tag: str) -> dict[str, Any]:
    """All prompts at once to the end: tokens, median per-request TPOT, drafts accepted."""
    sched = engine.scheduler
    drafts0, acc0 = sched.num_draft_tokens, sched.num_accepted_tokens
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, _options(max_tokens, k, cls))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
            times[o.request_id].extend([now] * len(o.new_token_ids))
    wall = time.perf_counter() - t0
    tpots = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in times.values() if len(t) > 1]
    drafts = sched.num_draft_tokens - drafts0
    accepted = sched.num_accepted_tokens - acc0
    return {"tokens": [tokens[rid] for rid in ids], "wall_s": round(wall, 3),
            "tpot_ms": round(statistics.median(tpots), 3) if tpots else None,
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafts, 4) if drafts else None}


def sweep_cost(engine: LLMEngine, prompts: list[list[int]], max_k: int) -> dict[str, float]:
    """ms per decode step of len(prompts) sequences with k wrong drafts each, k = 0..max_k."""
    out: dict[str, float] = {}
    proposer = engine.proposers[METHOD]
    engine.proposers[METHOD] = WrongDrafts(engine.model_config.vocab_size)
    try:
        with spec_settings(engine, budget=False, min_accepted=0.0):
            for k in range(max_k + 1):
                ids = [f"cost-{len(prompts)}-{k}-{i}" for i in range(len(prompts))]
                for rid, p in zip(ids, prompts, strict=True):
                    engine.add_request(rid, p, _options((k + 1) * (COST_STEPS + 4), k,
                                                        "probe_cost"))
                # The prompts (prefix hits after the first k), then one step to settle.
                while any(engine.scheduler.requests[r].num_output_tokens < 2 for r in ids):
                    engine.step()
                t0 = time.perf_counter()
                for _ in range(COST_STEPS):
                    engine.step()
                out[str(k)] = round((time.perf_counter() - t0) / COST_STEPS * 1e3, 3)
                for rid in ids:
                    engine.abort_request(rid)
                while engine.has_step_in_flight:
                    engine.step()
    finally:
        engine.proposers[METHOD] = proposer
        engine.spec_stats.forget("probe_cost")
    return out


def predict(engine: LLMEngine, cls: str, batch: int, max_k: int) -> dict[str, Any]:
    """The cost model's and measured acceptance's prediction for `batch` alike sequences."""
    cost = engine.spec_cost.cost()
    acceptance = engine.spec_stats.acceptance(METHOD, cls)
    if acceptance is None or not cost:
        return {"k": 0, "note": "nothing measured"}
    plain_s = cost.seconds_at(batch)
    per_k = {}
    for k in range(max_k + 1):
        tokens, rows = acceptance.tokens_and_rows(k)
        step_s = cost.seconds_at(batch * rows)
        per_k[str(k)] = {"tokens_per_step": round(tokens, 3), "rows_per_seq": round(rows, 3),
                         "step_ms": round(step_s * 1e3, 3),
                         "tpot_ms": round(step_s / tokens * 1e3, 3),
                         "gain": round(tokens * plain_s / step_s, 3) if step_s > 0 else None}
    choice = best_k(cost, acceptance, batch, max_k, 0.0, 1.1)  # the gateway's MIN_GAIN
    return {"k": choice.k, "gain": round(choice.gain, 3), "per_k": per_k,
            "accepted_per_pos": [round(a / acceptance.steps, 3) for a in acceptance.accepted]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    p.add_argument("--acceptance", default="0.3,0.6,0.9",
                   help="forced per-draft acceptance rates")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rates = [float(a) for a in args.acceptance.split(",")]
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, seed=1,
              max_model_len=args.input_len + args.output_len + 64,
              max_num_batched_tokens=8192, max_num_seqs=max(batches),
              gpu_memory_utilization=args.gpu_memory_utilization,
              speculative_config={"method": METHOD, "num_speculative_tokens": args.k,
                                  "calibration_max_batch": max(batches)})
    engine = llm.engine
    load_s = time.perf_counter() - started
    t = time.perf_counter()
    calibration_steps = engine.calibrate_speculation()
    calibration = {"seconds": round(time.perf_counter() - t, 2), "steps": calibration_steps,
                   "points_ms": [[round(r, 2), round(s * 1e3, 3)]
                                 for r, s in engine.spec_cost.points()]}
    print(json.dumps({"load_s": round(load_s, 1), "calibration": calibration}), flush=True)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    proposer = engine.proposers[METHOD]
    rows: list[dict[str, Any]] = []
    for b in batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(b)]
        row: dict[str, Any] = {"batch": b, "step_ms_by_k": sweep_cost(engine, prompts, args.k)}
        off = run_batch(engine, prompts, args.output_len, 0, "probe_off", f"off{b}")
        refs = [q + o for q, o in zip(prompts, off["tokens"], strict=True)]
        row["tpot_ms_off"] = off["tpot_ms"]
        row["by_acceptance"] = []
        for rate in rates:
            cls = f"forced_{round(rate * 100)}_b{b}"
            engine.proposers[METHOD] = ForcedAcceptance(refs, rate, vocab)
            with spec_settings(engine, budget=False, min_accepted=0.0):
                always = run_batch(engine, prompts, args.output_len, args.k, cls, f"al{b}-{rate}")
            pred = predict(engine, cls, b, args.k)
            pred["cap_sent"] = args.k if pred["k"] else 0
            with spec_settings(engine, budget=True, min_accepted=None):
                policy = run_batch(engine, prompts, args.output_len, pred["cap_sent"], cls,
                                   f"po{b}-{rate}")
            engine.proposers[METHOD] = proposer
            tpots = {"off": off["tpot_ms"], "always": always["tpot_ms"],
                     "policy": policy["tpot_ms"]}
            best = min(v for m, v in tpots.items() if m != "policy" and v)
            entry = {"forced_rate": rate, "prediction": pred, "tpot_ms": tpots,
                     "acceptance_measured": {"always": always["acceptance"],
                                             "policy": policy["acceptance"]},
                     "policy_vs_best_fixed": (round(best / policy["tpot_ms"], 3)
                                              if policy["tpot_ms"] else None),
                     "same_tokens_as_off": {
                         "always": always["tokens"] == off["tokens"],
                         "policy": policy["tokens"] == off["tokens"]}}
            row["by_acceptance"].append(entry)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ratios = [e["policy_vs_best_fixed"] for r in rows for e in r["by_acceptance"]
              if e["policy_vs_best_fixed"] is not None]
    doc = {"probe": "spec_policy_gpu", "model": args.model, "k": args.k,
           "input_len": args.input_len, "output_len": args.output_len,
           "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                      and args.device != "cpu" else "cpu"),
           "load_s": round(load_s, 1), "calibration": calibration,
           "cost_model_ms": [[round(r, 2), round(s * 1e3, 3)]
                             for r, s in engine.spec_cost.points()],
           "rows": rows, "worst_policy_vs_best_fixed": min(ratios) if ratios else None,
           "total_s": round(time.perf_counter() - started, 1), "git": git_info(),
           "command": "PYTHONPATH=. python3 tools/probes/probe_spec_policy_gpu.py " + " ".join(
               f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items())}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps({"worst_policy_vs_best_fixed": doc["worst_policy_vs_best_fixed"],
                      "total_s": doc["total_s"]}))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
