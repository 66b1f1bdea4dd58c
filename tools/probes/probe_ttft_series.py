"""TTFT of one long prompt, run after run, beside the GPU's clocks and power (run on the H200).

The suite's `ttft_4096` step takes the median of three runs, each after one warm-up prompt;
its first run came out 5-8 ms faster than the next two on every machine of one session
(`bench/results/h200/kv_ipc_pull_fix/`). This probe runs `--runs` fresh prompts back to back
after `--idle-s` of idling, times each `generate` (one output token), and samples
`nvidia-smi` every 20 ms meanwhile (SM clock, power draw, temperature, the throttle reasons),
so each run's TTFT can be read next to the clock it ran at.

Usage: PYTHONPATH=. python3 tools/probes/probe_ttft_series.py --out F [--runs 8] [--idle-s 5]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.results import git_info
from tools.probes.probe_ttft import build_llm

QUERY = ("timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
         "clocks_throttle_reasons.active")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--idle-s", type=float, default=5.0)
    args = p.parse_args()

    import torch

    from engine import SamplingParams

    llm = build_llm(args.model)  # the first-token probes' engine
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt() -> list[dict[str, list[int]]]:  # fresh tokens: no prefix-cache hit
        return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}]

    llm.generate(prompt(), params)  # compiles and allocates outside the series
    prompts = [prompt() for _ in range(args.runs)]
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader",
                            "-lms", "20"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(args.idle_s)
        torch.cuda.synchronize()
        runs: list[dict[str, Any]] = []
        for ids in prompts:
            t0 = time.time()
            s = time.perf_counter()
            llm.generate(ids, params)
            runs.append({"start_unix": t0, "ttft_ms": (time.perf_counter() - s) * 1e3})
        time.sleep(0.5)
    finally:
        smi.terminate()
        samples_text, _ = smi.communicate(timeout=10)
    samples = [line.split(", ") for line in samples_text.splitlines() if line.strip()]
    doc = {"input_len": args.input_len, "idle_s": args.idle_s, "runs": runs,
           "nvidia_smi_fields": QUERY.split(","), "nvidia_smi": samples,
           "gpu": torch.cuda.get_device_name(), "git": git_info(),
           "command": f"PYTHONPATH=. python3 tools/probes/probe_ttft_series.py --runs {args.runs} "
                      f"--idle-s {args.idle_s} --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print([round(r["ttft_ms"], 2) for r in runs])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
