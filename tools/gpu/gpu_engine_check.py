"""End-to-end GPU correctness of the fast path: Triton attention + CUDA graphs vs the torch
reference backend, on dummy weights of a real shape (run on the H200).

For each prompt the fast engine generates greedily; the reference engine then scores
prompt + continuation in one prefill pass. A fast-path token is accepted when the reference
ranks it at (or within `--tol` logits of) the top: random weights have near-ties that bf16
rounding may flip, so exact agreement alone would be a flaky criterion. Also reports how many
decode steps replayed a CUDA graph.

With `--quantization fp8` (W8A8) the bf16 tolerance cannot hold: W8A8 is a step function of its
input, so the fast path and the reference, whose attention differs in the last bits, drift apart
until they differ by about as much as W8A8 differs from bf16 (docs/api.md, "Weight
quantization"). The check then also scores every sequence with an unquantized reference and
widens each position's tolerance by twice that position's W8A8 noise, max |W8A8 - bf16| over the
vocabulary: a fast token passes when the quantized reference ranks it within tol * |top| + 2 *
noise of its top. A wrong scale or operand gives gaps far over that floor; the per-row arithmetic
itself is checked tightly, row against batch, by tools/gpu/fp8_linear_check.py.

Usage: PYTHONPATH=. python3 tools/gpu/gpu_engine_check.py --out $OUT/engine_check.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.draft_model import DraftModelProposer
from engine.request import Request
from engine_api.sampling_params import SamplingParams as SP
from tools.probes.probe_spec import PositionalOracle


def reference_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one full prefill through `llm`'s runner."""
    eng = llm.engine
    req = Request("ref", ids, SP(max_tokens=1, temperature=0), (), eng.max_model_len)
    eng.scheduler.add_request(req)
    out = eng.scheduler.schedule()
    assert len(out.scheduled) == 1 and out.scheduled[0].num_new_tokens == len(ids), out
    logits = eng.runner.logits_for(out).float().cpu()
    eng.scheduler.finish_request("ref", req.status.FINISHED_ABORTED)
    return logits


def continuation_logits(common: dict[str, Any], sequences: list[tuple[list[int], list[int]]]
                        ) -> list[torch.Tensor]:
    """A torch-backend reference engine of `common`'s settings scores each (prompt,
    continuation) in one prefill: the logits `[len(continuation), V]` that predict the
    continuation's tokens. The engine is released before returning."""
    # No prefix cache: every reference pass computes its whole sequence (the short-prompt pass
    # extends a prompt of the first, which would otherwise hit it).
    ref = LLM(**common, attention_backend="torch", enforce_eager=True,  # type: ignore[arg-type]
              enable_prefix_caching=False)
    preds = []
    for q, gen in sequences:
        logits = reference_logits(ref, q + gen)
        # logits[i] predicts token i+1: generated token j sits at position len(q)+j.
        preds.append(logits[len(q) - 1: len(q) - 1 + len(gen)])
    ref.shutdown()
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    return preds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--out", required=True)
    p.add_argument("--num-tokens", type=int, default=32)
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                   help="both engines use it: checks the Triton fp8 path against the torch one")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="1 runs the prompts one at a time: the batch-1 path (GEMV, graph bucket 1)")
    p.add_argument("--decode-overlap-min-batch", type=int, default=0,
                   help="the fast engine's micro-batch overlap threshold (e.g. 4: the batch of 8 "
                        "decodes runs as two overlapped halves); 0: off, the engine's default")
    p.add_argument("--quantization", default="none", choices=["none", "fp8", "int8"],
                   help="both engines use it (fp8: W8A8, int8: weight-only): checks the fast path's "
                        "attention, graphs and kernels on a quantized model")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="the fast engine speculates, up to this many drafts per step: after a "
                        "plain pass, the checked pass drafts that pass's tokens at each position "
                        "(tools/probes/probe_spec.py PositionalOracle), so its tokens come from verify "
                        "steps (graphs) that accept and reject drafts")
    p.add_argument("--piecewise-graph-max-tokens", type=int, default=2048,
                   help="the fast engine's piecewise graphs (the engine's default is 512; 2048 "
                        "also sends the batched pass's second step, ~950 prompt tokens beside "
                        "six decodes, through them); 0: off")
    p.add_argument("--draft-model", default=None,
                   help="the fast engine speculates with this draft model instead (e.g. the "
                        "target itself, so most drafts are accepted), --speculative-tokens "
                        "(default 4) per step; the checked pass is its own output")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="each engine's share of the GPU (the two run one after the other; "
                        "0.9 for a model over 0.4 of it, e.g. qwen3-30b-a3b)")
    args = p.parse_args()
    rng = random.Random(0)
    lens = [5, 17, 100, 333, 1000, 1500, 2047, 40]
    common = dict(model=args.model, dtype="bfloat16", max_model_len=4096,
                  max_num_batched_tokens=4096,
                  gpu_memory_utilization=args.gpu_memory_utilization, seed=1,
                  kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
                  quantization=args.quantization)
    t = time.perf_counter()
    spec: dict[str, Any] | None = (
        {"method": "ngram", "num_speculative_tokens": args.speculative_tokens}
        if args.speculative_tokens else None)
    if args.draft_model is not None:
        spec = {"model": args.draft_model, "num_speculative_tokens": args.speculative_tokens or 4,
                "draft_gpu_memory_utilization": 0.2}
    fast = LLM(**common, attention_backend="triton", enforce_eager=False,  # type: ignore[arg-type]
               decode_overlap_min_batch=args.decode_overlap_min_batch, speculative_config=spec,
               piecewise_graph_max_tokens=args.piecewise_graph_max_tokens)
    load_s = time.perf_counter() - t
    vocab = fast.engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]
    params = SamplingParams(temperature=0, max_tokens=args.num_tokens, ignore_eos=True)
    outs = fast.generate([{"prompt_token_ids": q} for q in prompts], params)
    if spec is not None and args.draft_model is None:
        # The checked pass verifies the plain pass's tokens as drafts.
        fast.engine.proposer = PositionalOracle(
            [q + o.outputs[0].token_ids for q, o in zip(prompts, outs, strict=True)])
        outs = fast.generate([{"prompt_token_ids": q} for q in prompts], params)
    if spec is None:
        # Prompts of 3-300 tokens one at a time, one that extends the 40-token prompt by 3
        # tokens (a prefix hit on its 2 full blocks, an 11-token tail) and a 64-token tail after
        # the 100-token prompt's 6 blocks: steps of the piecewise graphs.
        alone = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 12, 16, 17, 120, 300)]
        alone.append(prompts[-1] + [rng.randrange(vocab) for _ in range(3)])
        alone.append(prompts[2] + [rng.randrange(vocab) for _ in range(60)])
        for q in alone:
            prompts.append(q)
            outs += fast.generate([{"prompt_token_ids": q}], params)
    pieces = fast.engine.runner.piecewise
    piecewise_steps = pieces.num_steps if pieces is not None else 0
    del pieces
    graphs = fast.engine.runner.graphs
    replays = graphs.num_replays if graphs is not None else 0
    overlapped = fast.engine.runner.num_overlapped_steps
    vg = fast.engine.runner.verify_graphs
    spec_stats = {"speculative_tokens": args.speculative_tokens,
                  "draft_tokens": fast.engine.scheduler.num_draft_tokens,
                  "accepted_tokens": fast.engine.scheduler.num_accepted_tokens,
                  "verify_graph_replays": vg.num_replays if vg is not None else 0}
    proposer = fast.engine.proposer
    if isinstance(proposer, DraftModelProposer):
        spec_stats.update(draft_model=args.draft_model, draft_rounds=proposer.num_rounds,
                          draft_steps=proposer.num_steps,
                          draft_catchup_tokens=proposer.num_catchup_tokens)
    del proposer
    fast.shutdown()
    del fast, graphs, vg
    gc.collect()
    torch.cuda.empty_cache()
    sequences = [(q, out.outputs[0].token_ids) for q, out in zip(prompts, outs, strict=True)]
    preds = continuation_logits(common, sequences)
    # W8A8: each position's noise floor, how far the quantized reference is from bf16 there.
    noise = ([(a - b).abs().max(dim=-1).values for a, b in
              zip(preds, continuation_logits({**common, "quantization": "none"}, sequences),
                  strict=True)]
             if args.quantization == "fp8" else [torch.zeros(len(g)) for _, g in sequences])
    rows: list[dict[str, Any]] = []
    for (q, gen), pred, floor in zip(sequences, preds, noise, strict=True):
        top = pred.max(dim=-1).values
        chosen = pred.gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        gap = (top - chosen)
        rows.append({"prompt_len": len(q), "exact_argmax": int((gap == 0).sum()),
                     "tokens": len(gen), "max_gap": float(gap.max()),
                     "max_noise_floor": float(floor.max()),
                     "within_tol": bool((gap <= args.tol * top.abs().clamp(min=1)
                                         + 2 * floor).all())})
    ok = all(r["within_tol"] for r in rows)
    doc = {"model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
           "quantization": args.quantization,
           "max_num_seqs": args.max_num_seqs, "load_s": load_s, "graph_replays": replays,
           "decode_overlap_min_batch": args.decode_overlap_min_batch,
           "overlapped_decode_steps": overlapped,
           "piecewise_graph_max_tokens": args.piecewise_graph_max_tokens,
           "piecewise_steps": piecewise_steps,
           **spec_stats, "ok": ok,
           "rows": rows, "gpu": torch.cuda.get_device_name()}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    for r in rows:
        print(r)
    print(f"engine check: {'OK' if ok else 'MISMATCH'}; graph replays {replays}, "
          f"overlapped steps {overlapped}, "
          f"piecewise steps {piecewise_steps}; "
          f"speculation {spec_stats}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
