"""Where a step's time goes on the GPU (run on the H200): wall time vs GPU time per decode step
at batch 1 and 256, and torch.profiler kernel tables for a graph-less decode step and for the
4096-token prefill. Writes `<out-dir>/profile.json` and `profile_*.txt` tables.

Usage: PYTHONPATH=. python3 tools/gpu/h200_profile.py --out-dir $OUT [--model dummy:llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams


def _fill(llm: LLM, batch: int, input_len: int, seed: int) -> None:
    """Queue `batch` long-running requests and step until all are decoding."""
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(vocab) for _ in range(input_len)]
        llm.engine.add_request(f"p{seed}-{i}", ids, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.requests.values()):
        llm.engine.step()


def _decode_timing(llm: LLM, steps: int) -> dict[str, float]:
    eng = llm.engine
    walls, gpus = [], []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        eng.step()
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
        gpus.append(start.elapsed_time(end))
    return {"wall_ms_median": statistics.median(walls), "gpu_span_ms_median": statistics.median(gpus)}


def _host_breakdown(llm: LLM, steps: int) -> dict[str, float]:
    """Median host time of schedule / prepare / (replay or forward + sample) / update."""
    eng = llm.engine
    parts: dict[str, list[float]] = {"schedule": [], "execute": [], "update": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        out = eng.scheduler.schedule()
        t1 = time.perf_counter()
        sampled = eng.runner.execute(out)
        t2 = time.perf_counter()
        eng.scheduler.update_from_output(out, sampled)
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in parts.items()}


def _abort_all(llm: LLM) -> None:
    for rid in list(llm.engine.scheduler.requests):
        llm.engine.abort_request(rid)


def _table(prof: Any, path: Path, rows: int = 30) -> str:
    text = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    path.write_text(text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"model": args.model, "gpu": torch.cuda.get_device_name()}
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=8192, max_num_seqs=256,
              max_num_batched_tokens=8192)
    for batch, ctx in ((1, 1024), (64, 1024), (256, 1024)):
        _fill(llm, batch, ctx, seed=batch)
        _decode_timing(llm, 3)
        doc[f"decode_bs{batch}"] = {**_decode_timing(llm, 20), **_host_breakdown(llm, 10)}
        print(f"bs{batch}", doc[f"decode_bs{batch}"], flush=True)
        if batch == 256:
            graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None  # eager kernels
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    llm.engine.step()
                torch.cuda.synchronize()
            llm.engine.runner.graphs = graphs
            print(_table(prof, out / "profile_decode_bs256.txt"), flush=True)
        _abort_all(llm)
    rng = random.Random(5)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1)
    for _ in range(2):  # warm-up, distinct prompts (no prefix-cache hits)
        llm.generate([{"prompt_token_ids": [rng.randrange(vocab) for _ in range(4096)]}], params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": [rng.randrange(vocab) for _ in range(4096)]}], params)
        torch.cuda.synchronize()
        doc["prefill_4096_profiled_ms"] = (time.perf_counter() - t) * 1e3
    print(_table(prof, out / "profile_prefill_4096.txt"), flush=True)
    (out / "profile.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
