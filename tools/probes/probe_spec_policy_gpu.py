"""The speculative decoding policy on one engine (the H200 table of issue 37): per batch size,
the measured cost of a plain decode step and of verify steps of 1 + k tokens per sequence, the
worker's cost model at the same rows, the k the policy picks at a forced acceptance, and TPOT
with the policy on, off and always on.

One engine (default: dummy Llama-3.1-8B in bf16, no tokenizer) with n-gram speculation (k drafts
at most), its weights made a chain model (tools/probes/forced_acceptance.py: greedy decoding
picks a token known in advance, by a margin no bf16 rounding crosses), so that drafts are right
exactly as often as forced whatever the batch and step shape. In order:

1. start-up calibration as a decode worker runs it (`LLMEngine.calibrate_speculation`), timed;
   then a check that greedy decoding follows the chain (the probe stops if it does not);
2. per batch b, the cost sweep: for k in 0..K, b sequences decoding with k drafts each that are
   never right (a step's rows are b * (1 + k), checked), once all of them decode and
   SWEEP_WARMUP_STEPS later: ms per step over COST_STEPS steps, and the worker's cost model
   (`engine.spec_cost`, which every decode step refines) at the same rows;
3. per batch b and forced rate a (`--acceptance`): `off` (plain decoding), `always` (K drafts
   every step: the worker's step budget off, no pausing), each draft right with probability a
   (a verify step accepts its first draft with probability a, i + 1 drafts with a^(i+1)), as the
   engine counts them; the policy's prediction from the measured cost and acceptance
   (engine_api/spec_gain.py `best_k`, the gateway's rule and MIN_GAIN for b alike sequences);
   and `policy`: the cap as the gateway sends it (K when the predicted k is above 0, else 0; no
   SLO), the worker's step budget and pausing picking each step's drafts. Each mode runs
   `--repeats` times (off first; then always and policy in turn, the prediction after the first
   always-on run), and the run of median TPOT stands for it (`tpot_ms_runs`: all of them).

TPOT is per request (first to last token), the median over the batch. Every run's tokens are
checked against the chain (`follows_chain`). The JSON is rewritten after every batch, so a
killed run keeps its rows; a batch that fails is recorded with its error and the next one runs.

Usage (H200; `OUT=dir PARTS=spec_policy bash tools/gpu/run_h200.sh` runs it):
  PYTHONPATH=. python3 tools/probes/probe_spec_policy_gpu.py --out F
CPU smoke run (tiny dummy model in bf16, batches 1-4, seconds; test_probe_spec_policy.py):
  PYTHONPATH=. python3 tools/probes/probe_spec_policy_gpu.py --out F --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import environment_info, write_json
from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.spec import Proposer
from engine_api.request_options import RequestOptions
from engine_api.spec_gain import best_k, step_seconds
from tools.probes.forced_acceptance import Chain, ChainDrafter, make_chain_model

METHOD = "ngram"         # the proposer slot the chain drafter takes
COST_STEPS = 8           # timed decode steps per (batch, k) point of the sweep
SWEEP_WARMUP_STEPS = 2   # decode steps after every sequence decodes, before the timed ones
# gateway/spec_policy.py's MIN_GAIN (a test keeps them equal): not imported, so that the probe
# needs no gRPC or protobuf on the accelerator machine.
GATEWAY_MIN_GAIN = 1.1


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    model: str = "dummy:llama-3.1-8b"
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    rates: tuple[float, ...] = (0.3, 0.6, 0.9)
    k: int = 4
    input_len: int = 512
    output_len: int = 128
    dtype: str = "bfloat16"
    device: str = "auto"
    gpu_memory_utilization: float = 0.85
    max_num_batched_tokens: int = 8192
    cpu_threads: int | None = None  # the engine's default (the usable CPUs)
    async_scheduling: bool | None = None  # the engine's default (on for CUDA)
    # Runs of each mode per cell, interleaved (always, policy, always, ...): the median's TPOT.
    # One run each left a cell to the machine: on a lent H100 two runs drafting alike differed
    # by up to 20%.
    repeats: int = 3

    def sweep_tokens(self, batch: int) -> int:
        """Output tokens a sweep request has room for: one per step while the batch's prompts
        are computed (the first ones decode meanwhile, their rows taking part of each step's
        token budget), twice over; the warm-up and the timed steps; and k drafts' room (the
        scheduler cuts drafts at max_tokens). Too few, and the first requests finish before the
        last ones decode (at c86461f: batch 128 of 512-token prompts in 8192-token steps)."""
        prompt_share = max(1, self.max_num_batched_tokens - batch * (1 + self.k))
        fill_steps = -(-batch * self.input_len // prompt_share) + 2
        return 2 * fill_steps + SWEEP_WARMUP_STEPS + COST_STEPS + self.k + 4

    @property
    def max_model_len(self) -> int:
        return self.input_len + max(self.output_len, self.sweep_tokens(max(self.batches))) \
            + self.k + 16


# 32-token steps: batch 4's prompts take several steps, as batch 128's do on the H200; async
# scheduling as a CUDA engine runs it. One CPU thread: the tiny model's matmuls are too small to
# share, and on a busy machine threads that wait for each other made its steps ~9x slower.
SMOKE = ProbeConfig(model="dummy:tiny", batches=(1, 2, 4), input_len=32, output_len=48,
                    device="cpu", max_num_batched_tokens=32, cpu_threads=1, async_scheduling=True,
                    repeats=2)


@contextlib.contextmanager
def spec_settings(engine: LLMEngine, proposer: Proposer, budget: bool,
                  min_accepted: float | None) -> Iterator[None]:
    """The drafter, the worker's step budget on or off and the pause floor, for one run."""
    saved = engine.config, engine.spec_budget, engine.proposers[METHOD]
    spec = engine.config.speculative
    engine.proposers[METHOD] = proposer
    if min_accepted is not None:
        engine.config = dataclasses.replace(
            engine.config, speculative=dataclasses.replace(spec, min_accepted_per_step=min_accepted))
    if not budget:
        engine.spec_budget = None
    try:
        yield
    finally:
        engine.config, engine.spec_budget, engine.proposers[METHOD] = saved


@contextlib.contextmanager
def scheduled_rows(engine: LLMEngine) -> Iterator[list[tuple[int, int]]]:
    """(sequences, query rows) of every step scheduled inside the block."""
    sched = engine.scheduler
    schedule = sched.schedule
    seen: list[tuple[int, int]] = []

    def spy() -> Any:
        out = schedule()
        seen.append((len(out.scheduled), sum(s.num_new_tokens for s in out.scheduled)))
        return out

    sched.schedule = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del sched.schedule  # the class's method again


def drain(engine: LLMEngine) -> None:
    """Abort whatever is left (a failed batch) and finish the step in flight."""
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    while engine.has_step_in_flight:
        engine.step()


def _options(max_tokens: int, k: int, cls: str) -> RequestOptions:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return RequestOptions(params, num_speculative_tokens=k, speculative_method=METHOD,
                          speculative_class=cls)


def run_batch(engine: LLMEngine, chain: Chain, prompts: list[list[int]], max_tokens: int,
              k: int, cls: str, tag: str) -> dict[str, Any]:
    """All prompts at once to the end: median per-request TPOT, whether the tokens follow the
    chain, and the drafts the engine verified and accepted (per position: the share of verify
    steps that accepted at least i + 1 drafts)."""
    sched, stats = engine.scheduler, engine.spec_stats
    before = (sched.num_draft_tokens, sched.num_accepted_tokens, stats.num_drafts,
              list(stats.accepted_per_pos))
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
    drafts = sched.num_draft_tokens - before[0]
    accepted = sched.num_accepted_tokens - before[1]
    verify_steps = stats.num_drafts - before[2]
    per_pos = [round((a - b) / verify_steps, 4) if verify_steps else None
               for a, b in zip(stats.accepted_per_pos, before[3], strict=True)]
    want = [chain.continuation(p[-1], max_tokens) for p in prompts]
    return {"wall_s": round(wall, 3),
            "tpot_ms": round(statistics.median(tpots), 3) if tpots else None,
            "follows_chain": [tokens[rid] for rid in ids] == want,
            "draft_tokens": drafts, "accepted_tokens": accepted, "verify_steps": verify_steps,
            "acceptance": round(accepted / drafts, 4) if drafts else None,
            "accepted_per_pos": per_pos if verify_steps else None}


def sweep_cost(engine: LLMEngine, chain: Chain, prompts: list[list[int]], cfg: ProbeConfig
               ) -> dict[str, Any]:
    """ms per decode step of len(prompts) sequences with k wrong drafts each, k = 0..K, and
    the worker's cost model at the same rows."""
    b = len(prompts)
    max_tokens = cfg.sweep_tokens(b)
    measured: dict[str, float] = {}
    odd_rows: dict[str, list[tuple[int, int]]] = {}
    with spec_settings(engine, ChainDrafter(chain, 0.0), budget=False, min_accepted=0.0):
        for k in range(cfg.k + 1):
            ids = [f"cost-{b}-{k}-{i}" for i in range(b)]
            for rid, p in zip(ids, prompts, strict=True):
                engine.add_request(rid, p, _options(max_tokens, k, "probe_cost"))
            while True:  # every prompt computed (prefix hits after the first k)
                reqs = [engine.scheduler.requests.get(rid) for rid in ids]
                if any(r is None for r in reqs):
                    raise RuntimeError(f"a sweep request of batch {b} ended before all decoded "
                                       f"(max_tokens {max_tokens})")
                if all(r is not None and r.num_output_tokens >= 1 for r in reqs):
                    break
                engine.step()
            for _ in range(SWEEP_WARMUP_STEPS):
                engine.step()
            with scheduled_rows(engine) as seen:
                t0 = time.perf_counter()
                for _ in range(COST_STEPS):
                    engine.step()
                measured[str(k)] = round((time.perf_counter() - t0) / COST_STEPS * 1e3, 3)
            if any(s != (b, b * (1 + k)) for s in seen):
                odd_rows[str(k)] = seen
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_step_in_flight:
                engine.step()
    engine.spec_stats.forget("probe_cost")
    cost = engine.spec_cost.cost(b * cfg.input_len)  # the swept steps' context, about
    model = {str(k): round(cost.seconds_at(b * (1 + k), verify=k > 0) * 1e3, 3)
             for k in range(cfg.k + 1)}
    out: dict[str, Any] = {"step_ms_by_k": measured, "cost_model_ms_by_k": model}
    if odd_rows:  # (sequences, rows) of timed steps that were not b sequences of 1 + k rows
        out["unexpected_rows"] = odd_rows
    return out


def predict(engine: LLMEngine, cls: str, batch: int, max_k: int,
            kv_tokens: float) -> dict[str, Any]:
    """The cost model's and measured acceptance's prediction for `batch` alike sequences whose
    contexts sum to `kv_tokens`."""
    cost = engine.spec_cost.cost(kv_tokens)
    acceptance = engine.spec_stats.acceptance(METHOD, cls)
    if acceptance is None or not cost:
        return {"k": 0, "note": "nothing measured"}
    plain_s = step_seconds(cost, batch)
    per_k = {}
    for k in range(max_k + 1):
        tokens, rows = acceptance.tokens_and_rows(k)
        step_s = step_seconds(cost, batch, rows_per_seq=rows, verify=k > 0)  # as the policy
        per_k[str(k)] = {"tokens_per_step": round(tokens, 3), "rows_per_seq": round(rows, 3),
                         "step_ms": round(step_s * 1e3, 3),
                         "tpot_ms": round(step_s / tokens * 1e3, 3),
                         "gain": round(tokens * plain_s / step_s, 3) if step_s > 0 else None}
    choice = best_k(cost, acceptance, batch, max_k, 0.0, GATEWAY_MIN_GAIN)
    return {"k": choice.k, "gain": round(choice.gain, 3), "per_k": per_k,
            "accepted_per_pos": [round(a / acceptance.steps, 3) for a in acceptance.accepted]}


def _points_ms(engine: LLMEngine, verify: bool = False) -> list[list[float]]:
    """The step-cost model's (rows, ms) of plain (or verify) steps, at no context."""
    return [[round(r, 2), round(s * 1e3, 3)] for r, s in engine.spec_cost.points(verify=verify)]


def measure_batch(engine: LLMEngine, chain: Chain, prompts: list[list[int]], cfg: ProbeConfig
                  ) -> dict[str, Any]:
    b = len(prompts)
    row: dict[str, Any] = {"batch": b, **sweep_cost(engine, chain, prompts, cfg)}
    off = median_run([run_batch(engine, chain, prompts, cfg.output_len, 0, "probe_off",
                                f"off{b}-{i}") for i in range(cfg.repeats)])
    row["off"] = off
    row["by_acceptance"] = []
    for rate in cfg.rates:
        cls = f"forced_{round(rate * 100)}_b{b}"
        drafter = ChainDrafter(chain, rate)
        runs: dict[str, list[dict[str, Any]]] = {"always": [], "policy": []}
        pred: dict[str, Any] = {}
        for i in range(cfg.repeats):
            with spec_settings(engine, drafter, budget=False, min_accepted=0.0):
                runs["always"].append(run_batch(engine, chain, prompts, cfg.output_len, cfg.k,
                                                cls, f"al{b}-{rate}-{i}"))
            if not pred:  # from the first always-on run's numbers, as the gateway would
                pred = predict(engine, cls, b, cfg.k, b * (cfg.input_len + cfg.output_len / 2))
                pred["cap_sent"] = cfg.k if pred["k"] else 0
            with spec_settings(engine, drafter, budget=True, min_accepted=None):
                runs["policy"].append(run_batch(engine, chain, prompts, cfg.output_len,
                                                pred["cap_sent"], cls, f"po{b}-{rate}-{i}"))
        always, policy = median_run(runs["always"]), median_run(runs["policy"])
        tpots = {"off": off["tpot_ms"], "always": always["tpot_ms"], "policy": policy["tpot_ms"]}
        fixed = [v for m, v in tpots.items() if m != "policy" and v]
        row["by_acceptance"].append({
            "forced_rate": rate, "prediction": pred, "tpot_ms": tpots,
            "always": always, "policy": policy,
            "policy_vs_best_fixed": (round(min(fixed) / policy["tpot_ms"], 3)
                                     if policy["tpot_ms"] and fixed else None)})
    return row


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median TPOT (the lower middle of an even count), with every run's TPOT."""
    ordered = sorted(runs, key=lambda r: r["tpot_ms"] or 0.0)
    return {**ordered[(len(ordered) - 1) // 2], "tpot_ms_runs": [r["tpot_ms"] for r in runs]}


def table_line(row: dict[str, Any]) -> dict[str, Any]:
    """One batch's row of the issue's table."""
    if "error" in row:
        return {"batch": row["batch"], "error": row["error"]}
    return {"batch": row["batch"], "step_ms_by_k": row["step_ms_by_k"],
            "cost_model_ms_by_k": row["cost_model_ms_by_k"], "tpot_ms_off": row["off"]["tpot_ms"],
            "by_rate": {str(e["forced_rate"]): {
                "first_draft_accepted": (e["always"]["accepted_per_pos"] or [None])[0],
                "policy_k": e["prediction"]["k"],
                "tpot_ms_always": e["tpot_ms"]["always"], "tpot_ms_policy": e["tpot_ms"]["policy"],
                "policy_vs_best_fixed": e["policy_vs_best_fixed"]} for e in row["by_acceptance"]}}


def check_chain(engine: LLMEngine, chain: Chain) -> dict[str, Any]:
    """A short plain run and one with always-right drafts: the chain must hold in both."""
    rng = random.Random(1)
    prompts = [[rng.randrange(chain.vocab) for _ in range(16)] for _ in range(2)]
    plain = run_batch(engine, chain, prompts, 8, 0, "probe_check", "check-plain")
    with spec_settings(engine, ChainDrafter(chain, 1.0), budget=False, min_accepted=0.0):
        spec = run_batch(engine, chain, prompts, 8, 2, "probe_check", "check-spec")
    engine.spec_stats.forget("probe_check")
    if not (plain["follows_chain"] and spec["follows_chain"] and spec["acceptance"] == 1.0):
        raise RuntimeError(f"greedy decoding does not follow the chain model: plain {plain}, "
                           f"with right drafts {spec}")
    return {"stride": chain.stride, "plain_follows": True, "right_drafts_accepted": 1.0}


def run(cfg: ProbeConfig, out: Path, command: str = "") -> dict[str, Any]:
    """Measure and write `out` (after every batch); returns the document."""
    started = time.perf_counter()
    llm = LLM(model=cfg.model, dtype=cfg.dtype, device=cfg.device, seed=1,
              max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
              max_num_seqs=max(cfg.batches), gpu_memory_utilization=cfg.gpu_memory_utilization,
              cpu_threads=cfg.cpu_threads, async_scheduling=cfg.async_scheduling,
              speculative_config={"method": METHOD, "num_speculative_tokens": cfg.k,
                                  "calibration_max_batch": max(cfg.batches)})
    engine = llm.engine
    doc: dict[str, Any] = {"probe": "spec_policy_gpu", "config": dataclasses.asdict(cfg),
                           "command": command, "environment": environment_info(),
                           "device": engine.info.device, "complete": False}
    try:
        chain = make_chain_model(engine)
        doc["load_s"] = round(time.perf_counter() - started, 1)
        t = time.perf_counter()
        steps = engine.calibrate_speculation()
        doc["calibration"] = {"seconds": round(time.perf_counter() - t, 2), "steps": steps,
                              "points_ms": _points_ms(engine),
                              "verify_points_ms": _points_ms(engine, verify=True)}
        doc["chain"] = check_chain(engine, chain)
        print(f"load {doc['load_s']} s, calibration {doc['calibration']}", flush=True)
        doc["rows"], doc["table"] = [], []
        rng = random.Random(0)
        for b in cfg.batches:
            prompts = [[rng.randrange(chain.vocab) for _ in range(cfg.input_len)]
                       for _ in range(b)]
            t = time.perf_counter()
            try:
                row = measure_batch(engine, chain, prompts, cfg)
            except Exception as e:  # recorded; the next batch size still runs
                row = {"batch": b, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=-6)}
                drain(engine)
            row["wall_s"] = round(time.perf_counter() - t, 2)
            doc["rows"].append(row)
            doc["table"].append(table_line(row))
            doc["total_s"] = round(time.perf_counter() - started, 1)
            write_json(out, doc)
            print(doc["table"][-1], flush=True)
        ratios = [e["policy_vs_best_fixed"] for r in doc["rows"] for e in r.get("by_acceptance", ())
                  if e["policy_vs_best_fixed"] is not None]
        doc["worst_policy_vs_best_fixed"] = min(ratios) if ratios else None
        doc["cost_model_ms"] = _points_ms(engine)  # at no context
        doc["cost_model_verify_ms"] = _points_ms(engine, verify=True)
        doc["cost_model_s_per_kv_token"] = engine.spec_cost.per_kv_token
        doc["cost_model_verify_s_per_kv_token"] = engine.spec_cost.verify_per_kv_token
        doc["complete"] = all("error" not in r for r in doc["rows"])
    except Exception as e:
        doc["error"] = f"{type(e).__name__}: {e}"
        doc["traceback"] = traceback.format_exc(limit=-6)
        raise
    finally:
        doc["total_s"] = round(time.perf_counter() - started, 1)
        write_json(out, doc)
        llm.shutdown()
    return doc


def _numbers(text: str, kind: type) -> tuple[Any, ...]:
    return tuple(kind(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true",
                   help="the CPU smoke run: dummy:tiny in bf16, batches 1,2,4, short sequences "
                        "(other flags given override it)")
    default = ProbeConfig()
    p.add_argument("--model")
    p.add_argument("--batches", help=f"default {','.join(map(str, default.batches))}")
    p.add_argument("--acceptance", help="forced per-draft acceptance rates (default "
                                        f"{','.join(map(str, default.rates))})")
    p.add_argument("--k", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--dtype", choices=["bfloat16", "float32"])
    p.add_argument("--device")
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--repeats", type=int, help=f"runs of each mode per cell (default "
                                               f"{default.repeats}; the median counts)")
    args = p.parse_args(argv)
    cfg = SMOKE if args.smoke else default
    given = {"model": args.model, "k": args.k, "input_len": args.input_len,
             "output_len": args.output_len, "dtype": args.dtype, "device": args.device,
             "gpu_memory_utilization": args.gpu_memory_utilization, "repeats": args.repeats,
             "batches": _numbers(args.batches, int) if args.batches else None,
             "rates": _numbers(args.acceptance, float) if args.acceptance else None}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
    command = "PYTHONPATH=. python3 tools/probes/probe_spec_policy_gpu.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    doc = run(cfg, Path(args.out), command)
    print({"complete": doc["complete"], "worst_policy_vs_best_fixed":
           doc["worst_policy_vs_best_fixed"], "total_s": doc["total_s"]}, flush=True)
    return 0 if doc["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
