"""What a prompt arriving at low load costs the streams already decoding (run on the H200).

`--batch` requests decode at `--context` tokens; then, one at a time, a fresh prompt of each
`--prompt-lens` length joins them (one output token). Measured from `LLMEngine.step()`'s
returns (one step each, async scheduling as the engine runs it): the decode streams' median
step gap before any prompt, and for each arriving prompt its first token's latency and the
longest gap the decode streams saw while it was computed (the step that carries its tokens:
with CUDA graphs on, a pure-decode step replays a graph and a step with prompt tokens does not,
unless it fits the piecewise graphs).

Usage: PYTHONPATH=. python3 tools/probes/probe_mixed_steps.py --out F [--piecewise-graph-max-tokens 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.results import git_info
from tools.probes import probe_ttft


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prompt-lens", default="17,64,128,256,512,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--piecewise-graph-max-tokens", type=int, default=None,
                   help="the engine's piecewise graphs (default: the engine's; 0: off)")
    args = p.parse_args()
    lens = [int(n) for n in args.prompt_lens.split(",")]

    from engine import SamplingParams

    llm = probe_ttft.build_llm(args.model, args.piecewise_graph_max_tokens)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(5)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    decoding = [f"d{i}" for i in range(args.batch)]
    for rid in decoding:
        engine.add_request(rid, fresh(args.context),
                           SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
    seen: set[str] = set()
    while len(seen) < len(decoding):
        seen.update(o.request_id for o in engine.step() if o.new_token_ids)

    def gaps(num_steps: int) -> list[float]:
        out, t = [], time.perf_counter()
        for _ in range(num_steps):
            engine.step()
            now = time.perf_counter()
            out.append((now - t) * 1e3)
            t = now
        return out

    gaps(10)  # settle
    baseline = gaps(30)
    rows: dict[str, Any] = {}
    for n in lens:
        firsts, worst = [], []
        for r in range(args.repeats + 1):
            rid = f"p{n}_{r}"
            t0 = t = time.perf_counter()
            engine.add_request(rid, fresh(n), SamplingParams(temperature=0.0, max_tokens=1))
            window, first = [], None
            while first is None:
                outs = engine.step()
                now = time.perf_counter()
                window.append((now - t) * 1e3)
                t = now
                if any(o.request_id == rid and o.new_token_ids for o in outs):
                    first = (now - t0) * 1e3
            gaps(3)  # back to pure decode between arrivals
            if r:  # the first arrival of each length warms its buckets and kernels
                firsts.append(first)
                worst.append(max(window))
        rows[str(n)] = {"first_token_ms": firsts, "median_first_token_ms": statistics.median(firsts),
                        "decode_worst_gap_ms": worst,
                        "median_decode_worst_gap_ms": statistics.median(worst)}
        print(f"prompt {n}: first token {statistics.median(firsts):.2f} ms, decode streams' "
              f"longest gap {statistics.median(worst):.2f} ms (median of {args.repeats})")
    after = gaps(30)  # pure decode again, after steps of every kind
    for rid in decoding:
        engine.abort_request(rid)
    pieces = engine.runner.piecewise
    doc = {**git_info(), "model": args.model, "batch": args.batch, "context": args.context,
           "piecewise_graph_max_tokens": engine.config.runner.piecewise_graph_max_tokens,
           "piecewise_steps": pieces.num_steps if pieces is not None else 0,
           "decode_gap_ms_median": statistics.median(baseline), "decode_gaps_ms": baseline,
           # The context grew by the steps in between (a few dozen tokens of 1k).
           "decode_gap_ms_median_after": statistics.median(after),
           "prompts": rows}
    import torch

    doc["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"decode step gap before prompts: median {doc['decode_gap_ms_median']:.2f} ms, "
          f"after: {doc['decode_gap_ms_median_after']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
