"""Where an engine's start-up time goes (run on the H200): builds one `LLM` under cProfile and
writes the wall time and the functions with the most cumulative and own time.

Usage: PYTHONPATH=. python3 tools/probes/probe_build.py --out F [--model dummy:llama-3.2-1b]
       [--piecewise-graph-max-tokens N] [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import time
from pathlib import Path

from bench.results import git_info
from tools.probes import probe_ttft
from tools.profiling import profile_text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--piecewise-graph-max-tokens", type=int, default=None,
                   help="the engine's piecewise graphs (default: the engine's; 0: off)")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()

    import torch

    torch.cuda.init()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm = probe_ttft.build_llm(args.model, args.piecewise_graph_max_tokens)
    prof.disable()
    build_s = time.perf_counter() - t0
    runner = llm.engine.runner
    doc = {**git_info(), "gpu": torch.cuda.get_device_name(), "model": args.model,
           "piecewise_graph_max_tokens": llm.engine.config.runner.piecewise_graph_max_tokens,
           "piecewise_buckets": runner.piecewise.buckets if runner.piecewise else [],
           "decode_buckets": runner.graphs.buckets if runner.graphs else [],
           "build_s": build_s,
           "top_cumulative": profile_text(prof, "cumulative", args.top),
           "top_own": profile_text(prof, "tottime", args.top)}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{args.model}: LLM built in {build_s:.1f} s")
    print(doc["top_cumulative"][:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
