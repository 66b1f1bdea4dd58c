"""Speculative decoding on the GPU: per-request decode speed with and without drafts, and
whether the verify path gives plain decoding's tokens (run on the H200).

One engine with `--speculative-method ngram` (or `draft_model` with `--draft-model`) serves every
mode, so the weights and graphs are the same; each request picks its drafts per step
(`num_speculative_tokens`):

- `plain`: 0 drafts (the decode graphs, async scheduling);
- `ngram`: prompt lookup, up to k drafts per step (the verify graphs);
- `draft` (with `--draft-model`): the draft model's k greedy drafts per step. With dummy
  weights nearly all are rejected; with `--min-accepted 0` drafting never pauses, so its TPOT is
  the cost of a whole round (the draft's k steps and the verify step), which barely depends on
  how many drafts are accepted (one more draft step when all are); `draft_s` is the part spent in the draft engine;
- `reject`: k drafts every step that are never the model's tokens: the verify step's cost
  with nothing gained (its TPOT is the step time of a k-draft verify graph);
- `oracle`: the plain run's token at each position as the draft for it: accepted until the
  run's own tokens part from plain decoding's, then rejected.

Dummy weights make the n-gram rate a property of the random model's outputs, not of real
text: the per-step costs (`plain`, `reject`) are what carry over, and with them the acceptance
a proposer needs to win. Greedy tokens of the spec modes are compared with `plain`: the verify
step runs the paged prefill kernel where plain decoding runs the decode kernel, so bf16
rounding flips near-ties (random weights have many, see gpu_engine_check's exact_argmax); the
first divergence is reported, not hidden.

Usage: PYTHONPATH=. python3 tools/probes/probe_spec.py --out F [--model dummy:llama-3.1-8b]
       [--batches 1,4,16] [--k 4] [--input-len 1000] [--output-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.results import git_info
from engine import LLM, SamplingParams
from engine.draft_model import DraftModelProposer
from engine.outputs import StepOutput
from engine.spec import SequenceProposer

# Real-text tasks where prompt lookup is expected to find drafts (the model copies spans of its
# input or of its own output) and one where it is not (free writing): with a real model
# (`--model ""`, the embedded SmolLM2) and `--prompts chat` the n-gram rows measure acceptance
# on text rather than on a random model's loops.
CHAT_PROMPTS = [
    "Add type hints to this Python function and return the whole function:\n\n"
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
    "Convert this list to JSON objects with keys name and city, one per line:\n"
    "Alice - Paris\nBob - London\nCarla - Madrid\nDavid - Berlin\nEmma - Rome\n"
    "Farid - Cairo\nGrace - Dublin\nHiro - Tokyo",
    "Repeat the following sentence exactly three times: The quick brown fox jumps over the "
    "lazy dog while the cat sleeps on the warm windowsill.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    """The first `n` of CHAT_PROMPTS (cycled) as chat-templated token ids."""
    tok = llm.engine.tokenizer
    if tok is None:
        raise SystemExit("--prompts chat needs a model with a tokenizer (e.g. --model '')")
    return [tok.encode(tok.apply_chat_template(  # type: ignore[arg-type]
        [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
        add_generation_prompt=True), add_special_tokens=False) for i in range(n)]


class PositionalOracle(SequenceProposer):
    """Drafts a reference run's tokens at the next positions of the same prompt (a benchmark
    input, not a proposer): right while the sequence follows the reference, wrong after."""

    def __init__(self, full_sequences: Sequence[list[int]]) -> None:
        self.by_prefix = {tuple(seq[:16]): seq for seq in full_sequences}

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        seq = self.by_prefix.get(tuple(token_ids[:16]))
        return [] if seq is None else seq[len(token_ids):len(token_ids) + k]


class RejectedDrafts(SequenceProposer):
    """k drafts that greedy decoding will not pick: the verify step's cost alone."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [(token_ids[-1] + 7 * (j + 1)) % self.vocab for j in range(k)]


def proposer_counters(proposer: object) -> dict[str, float] | None:
    """A draft model's rounds, engine steps, seconds and prompt tokens computed, for deltas."""
    if not isinstance(proposer, DraftModelProposer):
        return None
    return {"rounds": proposer.num_rounds, "steps": proposer.num_steps,
            "s": proposer.busy_s, "catchup_tokens": proposer.num_catchup_tokens}


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams,
              spec_tokens: int | None, tag: str) -> dict[str, Any]:
    """All prompts at once; per-request TPOT from its token arrival times."""
    eng = llm.engine
    sched, runner = eng.scheduler, eng.runner
    drafts0, acc0 = sched.num_draft_tokens, sched.num_accepted_tokens
    vg = runner.verify_graphs
    vreplays0 = vg.num_replays if vg is not None else 0
    dreplays0 = runner.graphs.num_replays if runner.graphs is not None else 0
    draft0 = proposer_counters(eng.proposer)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        eng.add_request(rid, p, params, num_speculative_tokens=spec_tokens)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    steps = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        outs: list[StepOutput] = eng.step()
        now = time.perf_counter()
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
            times[o.request_id].extend([now] * len(o.new_token_ids))
        steps += 1
    wall = time.perf_counter() - t0
    draft = proposer_counters(eng.proposer)
    tpots = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in times.values() if len(t) > 1]
    drafts = sched.num_draft_tokens - drafts0
    accepted = sched.num_accepted_tokens - acc0
    n_out = sum(len(t) for t in tokens.values())
    if draft0 is not None and draft is not None:
        extra = {f"draft_{k}": round(v - draft0[k], 3) for k, v in draft.items()}
    else:
        extra = {}
    return {
        "tokens": [tokens[rid] for rid in ids],
        **extra,
        "wall_s": round(wall, 3), "steps": steps,
        "output_tok_s": round(n_out / wall, 1),
        "tpot_ms_mean": round(statistics.mean(tpots), 3) if tpots else None,
        "tpot_ms_median": round(statistics.median(tpots), 3) if tpots else None,
        "draft_tokens": drafts, "accepted_tokens": accepted,
        "acceptance": round(accepted / drafts, 4) if drafts else None,
        "tokens_per_step": round(n_out / len(prompts) / max(1, steps), 3),
        "verify_graph_replays": (vg.num_replays - vreplays0) if vg is not None else 0,
        "decode_graph_replays": ((runner.graphs.num_replays - dreplays0)
                                 if runner.graphs is not None else 0),
    }


def compare(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    first = []
    for g, w in zip(got, want, strict=True):
        first.append(next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b),
                          None if len(g) == len(w) else min(len(g), len(w))))
    return {"identical": sum(f is None for f in first), "of": len(got),
            "first_divergence": first}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompts", default="random", choices=["random", "chat"],
                   help="random: --input-len random tokens; chat: CHAT_PROMPTS through the "
                        "model's chat template (real text; use a real model)")
    p.add_argument("--modes", default="plain,ngram,reject,oracle",
                   help="which of plain, ngram (or draft), reject, oracle to run (plain always "
                        "runs: the others are compared with it)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every mode (0: greedy; with > 0, tokens are "
                        "not compared with plain's, and acceptance is the random rule's)")
    p.add_argument("--draft-model", default=None,
                   help="speculate with this draft model (e.g. dummy:llama-3.2-1b); mode "
                        "`draft` runs it")
    p.add_argument("--draft-gpu-memory-utilization", type=float, default=None,
                   help="SpeculativeConfig.draft_gpu_memory_utilization (default: the engine's)")
    p.add_argument("--min-accepted", type=float, default=None,
                   help="SpeculativeConfig.min_accepted_per_step (default: the engine's)")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    modes = {m.strip() for m in args.modes.split(",")}
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.draft_model is not None:
        spec.update(method="draft_model", model=args.draft_model)
    if args.draft_gpu_memory_utilization is not None:
        spec["draft_gpu_memory_utilization"] = args.draft_gpu_memory_utilization
    if args.min_accepted is not None:
        spec["min_accepted_per_step"] = args.min_accepted
    own = "draft" if args.draft_model is not None else "ngram"
    t = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=1,
              max_num_batched_tokens=8192, max_num_seqs=max(batches),
              gpu_memory_utilization=args.gpu_memory_utilization,
              speculative_config=spec)
    load_s = time.perf_counter() - t
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True)
    proposer = llm.engine.proposer
    assert proposer is not None  # main() configured speculative decoding
    rows: list[dict[str, Any]] = []
    for b in batches:
        prompts = (chat_prompts(llm, b) if args.prompts == "chat" else
                   [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(b)])
        # Prefill once untimed so every mode decodes over cached prompts (prefix hits).
        run_batch(llm, prompts, SamplingParams(temperature=0, max_tokens=1), 0, f"warm{b}")
        runs = {"plain": run_batch(llm, prompts, params, 0, f"plain{b}")}
        plain = runs["plain"]
        if own in modes:
            runs[own] = run_batch(llm, prompts, params, None, f"{own}{b}")
        if "reject" in modes:
            llm.engine.proposer = RejectedDrafts(vocab)
            runs["reject"] = run_batch(llm, prompts, params, None, f"reject{b}")
        if "oracle" in modes:
            llm.engine.proposer = PositionalOracle(
                [q + o for q, o in zip(prompts, plain["tokens"], strict=True)])
            runs["oracle"] = run_batch(llm, prompts, params, None, f"oracle{b}")
        llm.engine.proposer = proposer
        for mode, r in runs.items():
            row = {"batch": b, "mode": mode, **{k: v for k, v in r.items() if k != "tokens"}}
            if mode != "plain":
                if not args.temperature:
                    row["vs_plain"] = compare(r["tokens"], plain["tokens"])
                row["speedup_tpot"] = round(plain["tpot_ms_median"] / r["tpot_ms_median"], 3)
            rows.append(row)
            print(json.dumps(row))
    doc = {"model": args.model, "k": args.k, "speculative_config": spec,
           "verify_attention": os.environ.get("SPLITSERVE_VERIFY_ATTENTION", "decode"), "input_len": args.input_len,
           "output_len": args.output_len, "load_s": round(load_s, 1), "rows": rows,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "git": git_info(),
           "command": "PYTHONPATH=. python3 tools/probes/probe_spec.py " + " ".join(
               f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items()
               if k != "out")}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
