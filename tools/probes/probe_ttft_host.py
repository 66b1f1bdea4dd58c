"""What the host does while the device waits, in one long prompt's first token (run on the H200).

`probe_ttft.py` splits a 4096-token `generate` into host time before the first kernel, kernels,
idle gaps and host time after the last kernel; this probe names the Python behind the host
parts. One `generate` is traced by torch.profiler with Python stacks (`with_stack`), the trace
exported as Chrome JSON and read back: for the window before the device's first activity, each
of the largest idle gaps and the window after its last activity, the Python functions' *own*
time inside the window (time in a function minus time in the functions it called), largest
first. A cProfile of one more `generate` (by own and cumulative time), the unprofiled `generate`
times and, unprofiled, the request's time from arrival to its step's input copies (host only)
and from there to its first token go to the same JSON, and an A/B of the first-token time
with the runner's pinned input staging (engine/host_staging.py) and without it, alternating.

Usage: PYTHONPATH=. python3 tools/probes/probe_ttft_host.py --out F [--input-len 4096] [--gaps 8]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import random
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import git_info
from tools.probes import probe_ttft
from tools.profiling import profile_text

MARK = "ttft_host_generate"
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}  # a test may widen it


@dataclass(frozen=True, slots=True)
class Span:
    start: float  # µs, the trace's clock
    end: float
    name: str


def _own_time_in(spans: list[Span], lo: float, hi: float) -> dict[str, float]:
    """Own time (µs) of each Python function inside [lo, hi]: its overlap with the window less
    its direct callees' overlaps. `spans` sorted by (start, -duration): nesting follows."""
    own: dict[str, float] = defaultdict(float)
    stack: list[Span] = []

    def overlap(s: Span) -> float:
        return max(0.0, min(s.end, hi) - max(s.start, lo))

    for s in spans:
        if s.start >= hi:
            break
        while stack and stack[-1].end <= s.start:
            stack.pop()
        ov = overlap(s)
        if stack and ov:
            own[stack[-1].name] -= ov
        if s.end > lo:
            own[s.name] += ov
        stack.append(s)
    return dict(own)


def _engine_inclusive(spans: list[Span], lo: float, hi: float) -> dict[str, float]:
    """Time (µs) inside [lo, hi] under each of the engine's own functions (callees included),
    to say which step of the engine a leaf's own time belongs to."""
    inc: dict[str, float] = defaultdict(float)
    for s in spans:
        if "engine/" in s.name and s.start < hi and s.end > lo:
            inc[s.name] += min(s.end, hi) - max(s.start, lo)
    return dict(inc)


def _top(own: dict[str, float], n: int) -> list[dict[str, Any]]:
    rows = sorted(own.items(), key=lambda kv: -kv[1])[:n]
    return [{"us": round(us, 1), "function": name[:110]} for name, us in rows if us > 0.5]


def analyse_trace(path: Path, gaps: int, rows: int) -> dict[str, Any]:
    """The windows where the device idled during the marked `generate`, and what Python ran
    in each."""
    events = json.loads(path.read_text())["traceEvents"]
    mark = next(e for e in events if e.get("name") == MARK and e.get("cat") == "user_annotation")
    t0, t1 = float(mark["ts"]), float(mark["ts"]) + float(mark["dur"])
    device = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e["name"]))
                    for e in events if e.get("cat") in DEVICE_CATEGORIES
                    and t0 <= float(e["ts"]) <= t1)
    by_thread: dict[Any, list[Span]] = defaultdict(list)  # Python nests within a thread
    for e in events:
        if (e.get("cat") == "python_function" and float(e["ts"]) < t1
                and float(e["ts"]) + float(e.get("dur", 0)) > t0):
            by_thread[e.get("tid")].append(
                Span(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e["name"])))
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s.start, -(s.end - s.start)))
    windows: list[tuple[str, float, float, str, str]] = [
        ("before_first_device_op", t0, device[0][0], "", device[0][2])]
    idle: list[tuple[float, float, str, str]] = []
    cur_end, last = device[0][1], device[0][2]
    for start, end, name in device[1:]:
        if start > cur_end:
            idle.append((cur_end, start, last, name))
        if end >= cur_end:
            cur_end, last = end, name
    idle.sort(key=lambda g: g[0] - g[1])
    windows += [(f"gap_{i}", lo, hi, a, b) for i, (lo, hi, a, b) in enumerate(idle[:gaps])]
    windows.append(("after_last_device_op", cur_end, t1, last, ""))
    return {
        "generate_us": t1 - t0,
        "device_ops": len(device),
        "idle_gaps": len(idle),
        "idle_us_total": sum(hi - lo for lo, hi, _, _ in idle),
        "windows": [{"window": w, "us": round(hi - lo, 1), "after": a[:60], "before": b[:60],
                     "python_own_time": {str(tid): top for tid, spans in by_thread.items()
                                         if (top := _top(_own_time_in(spans, lo, hi), rows))},
                     "engine_inclusive": {str(tid): top for tid, spans in by_thread.items()
                                          if (top := _top(_engine_inclusive(spans, lo, hi),
                                                          rows))}}
                    for w, lo, hi, a, b in windows],
    }


def _mark_input_copies(llm: Any) -> list[float]:
    """perf_counter times at which the runner queued a step's input copies (unprofiled; empty
    on an engine without pinned staging)."""
    marks: list[float] = []
    staging = llm.engine.runner.inputs.staging
    if staging is not None:
        queued = staging.copied

        def copied(stream: Any = None) -> None:
            marks.append(time.perf_counter())
            queued(stream)
        staging.copied = copied
    return marks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gaps", type=int, default=8)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--ab", type=int, default=8,
                   help="alternations of TTFT with the runner's pinned staging and without "
                        "(a pinned allocation per step, as before it)")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    llm = probe_ttft.build_llm(args.model)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt() -> list[dict[str, list[int]]]:  # fresh tokens: no prefix-cache hit
        return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}]

    for _ in range(2):
        llm.generate(prompt(), params)
    plain, phases = [], []
    copies = _mark_input_copies(llm)
    for _ in range(args.repeats):
        ids = prompt()
        torch.cuda.synchronize()
        copies.clear()
        t = time.perf_counter()
        (out,) = llm.generate(ids, params)
        plain.append((time.perf_counter() - t) * 1e3)
        m = out.metrics
        if copies and m is not None and m.first_token_time is not None:
            phases.append({
                "ttft_ms": (m.first_token_time - m.arrival_time) * 1e3,
                # arrival (the request queued) -> the step's input copies queued: host only
                "arrival_to_input_copies_ms": (copies[0] - m.arrival_time) * 1e3,
                "generate_to_arrival_ms": (m.arrival_time - t) * 1e3,
                "input_copies_to_first_token_ms": (m.first_token_time - copies[0]) * 1e3})
    ab: dict[str, list[float]] = {"staging": [], "per_step_pinned_alloc": []}
    runner = llm.engine.runner
    staging = runner.inputs.staging
    for _ in range(args.ab if staging is not None else 0):
        for arm in ab:  # alternating, one engine: the arms differ only in the input buffers
            runner.inputs.staging = staging if arm == "staging" else None
            ids = prompt()
            torch.cuda.synchronize()
            (out,) = llm.generate(ids, params)
            m = out.metrics
            assert m is not None and m.first_token_time is not None
            ab[arm].append((m.first_token_time - m.arrival_time) * 1e3)
    runner.inputs.staging = staging
    prof_c = cProfile.Profile()
    ids = prompt()
    torch.cuda.synchronize()
    prof_c.enable()
    llm.generate(ids, params)
    prof_c.disable()
    traces = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2):
            ids = prompt()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                         with_stack=True) as prof:
                with torch.profiler.record_function(MARK):
                    llm.generate(ids, params)
                torch.cuda.synchronize()
            path = Path(tmp) / f"trace{i}.json"
            prof.export_chrome_trace(str(path))
            traces.append(analyse_trace(path, args.gaps, args.rows))
    doc = {**git_info(), "gpu": torch.cuda.get_device_name(), "input_len": args.input_len,
           "generate_ms_unprofiled": plain,
           "median_generate_ms_unprofiled": statistics.median(plain),
           "unprofiled_phases": phases,
           "ab_ttft_ms": ab,
           "ab_median_ttft_ms": {k: statistics.median(v) for k, v in ab.items() if v},
           "traced": traces,
           "cprofile_own": profile_text(prof_c, "tottime", 40).splitlines(),
           "cprofile_cumulative": profile_text(prof_c, "cumulative", 60).splitlines()}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("unprofiled generate ms", [round(x, 2) for x in plain])
    for ph in phases:
        print({k: round(v, 3) for k, v in ph.items()})
    print("A/B TTFT ms", json.dumps(ab), doc["ab_median_ttft_ms"])
    for w in traces[-1]["windows"]:
        print(w["window"], w["us"], w["after"], "->", w["before"])
        for tid, top in w["python_own_time"].items():
            for r in top[:8]:
                print("    ", tid, r["us"], r["function"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
