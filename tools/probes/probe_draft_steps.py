"""Where a draft-model round's time goes (diagnostic, run on the GPU): per launched draft step,
wall time with and without a device sync after it, and whether it replayed a decode graph.
Each round appends one token that the draft did not propose (as after a rejection).

Usage: PYTHONPATH=. python3 tools/probes/probe_draft_steps.py --out F [--model dummy:llama-3.1-8b]
       [--draft-model dummy:llama-3.2-1b] [--batch 1] [--rounds 24]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from typing import Any

import torch

from bench.results import git_info
from engine import LLM, SamplingParams
from engine.draft_model import DraftModelProposer
from engine.request import Request


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--draft-model", default="dummy:llama-3.2-1b")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    llm = LLM(model=args.model, max_model_len=2048, seed=1, max_num_seqs=max(args.batch, 1),
              gpu_memory_utilization=0.5,
              speculative_config={"model": args.draft_model, "num_speculative_tokens": args.k,
                                  "min_accepted_per_step": 0})
    proposer = llm.engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    reqs = []
    for i in range(args.batch):
        req = Request(f"p{i}", [rng.randrange(vocab) for _ in range(args.input_len)],
                      SamplingParams(temperature=0))
        req.num_speculative_tokens = args.k
        reqs.append(req)
    # Warm: the draft computes the prompts once (it keeps their KV).
    proposer.propose_batch(reqs)
    steps: list[dict[str, Any]] = []
    real_launch = proposer._launch
    sync = {"on": False}
    runner = proposer.runner

    def timed_launch(step: list[Any], keep_probs: bool = False) -> Any:
        graphs = runner.graphs
        replays = graphs.num_replays if graphs is not None else 0
        t0 = time.perf_counter()
        out = real_launch(step, keep_probs)
        t1 = time.perf_counter()
        if sync["on"]:
            _sync()
        t2 = time.perf_counter()
        steps.append({"sync": sync["on"], "call_ms": (t1 - t0) * 1e3,
                      "with_sync_ms": (t2 - t0) * 1e3, "rows": len(step),
                      "graph": (graphs.num_replays if graphs is not None else 0) > replays})
        return out

    proposer._launch = timed_launch  # type: ignore[method-assign]
    rounds: list[dict[str, Any]] = []
    for r in range(2 * args.rounds):
        sync["on"] = r >= args.rounds
        for req in reqs:
            req.all_token_ids.append(rng.randrange(vocab))
        n0 = len(steps)
        t0 = time.perf_counter()
        proposer.propose_batch(reqs)
        _sync()
        rounds.append({"sync": sync["on"], "round_ms": (time.perf_counter() - t0) * 1e3,
                       "steps": steps[n0:]})
    # Host hot spots of plain rounds (no added syncs), cumulative time.
    proposer._launch = real_launch  # type: ignore[method-assign]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.rounds):
        for req in reqs:
            req.all_token_ids.append(rng.randrange(vocab))
        proposer.propose_batch(reqs)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    with open(args.out.removesuffix(".json") + "_cprofile.txt", "w") as f:
        f.write(text.getvalue())
    summary = {}
    for mode in (False, True):
        rs = [r for r in rounds[2:] if r["sync"] is mode]
        summary["sync_each_step" if mode else "as_run"] = {
            "round_ms_median": round(statistics.median(r["round_ms"] for r in rs), 3),
            "steps_per_round": statistics.mean(len(r["steps"]) for r in rs),
            "step_ms_median_by_index": [
                round(statistics.median(r["steps"][i]["with_sync_ms"] for r in rs
                                        if len(r["steps"]) > i), 3)
                for i in range(max(len(r["steps"]) for r in rs))],
            "graph_by_index": [s["graph"] for s in rs[0]["steps"]],
        }
    doc = {"model": args.model, "draft_model": args.draft_model, "batch": args.batch,
           "k": args.k, "input_len": args.input_len, "summary": summary,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "git": git_info(),
           "command": f"PYTHONPATH=. python3 tools/probes/probe_draft_steps.py --batch {args.batch} "
                      f"--draft-model {args.draft_model} --rounds {args.rounds}"}
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
