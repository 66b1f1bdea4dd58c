"""The speculative decoding policy against always-off and always-on speculation, through the
real services on this machine: `splitserve up` (prefill + decode worker with suffix decoding
and n-gram lookup, 4 drafts at most, and its gateway with the default adaptive policy), plus
three more gateways in front of the same workers that differ only in their policy: off
(`--speculative-tokens 0`), always n-gram, always suffix (`--speculative-policy always
--speculative-policy-method ...`).

Two workloads: repetitive code edits (the prompt holds a function and asks for it again with
one change: the output repeats the prompt) and free-form stories. For each workload and
concurrency, `--rounds` rounds (4 give each mode every prompt set once); within a round the four gateways run one after another in an
order that rotates from cell to cell and round to round (interleaved A/B/C/D), each sending the cell's requests (greedy, `--max-tokens`
tokens each, EOS ignored) `concurrency` at a time. Reported per cell: output tokens per second
of each policy (the mean over rounds), and the policy's ratio to the best of the others;
`worst_policy_ratio_vs_best` is the least of those ratios. Since the modes of a round run back
to back, each row also has the ratio round by round against that best mode (`paired`: the
rounds' ratios, their mean and its standard error), which tells a loss from the machine's
drift. Per row and mode, what the decode worker did in that mode's runs (`worker_by_mode`:
verify steps with drafts, drafts accepted, drafting rounds by the drafts its step budget
allowed, pauses begun). Rows are written to `F.partial` as they finish. Also the policy
gateway's decisions and the decode worker's measured step cost and acceptance at the end.

Usage: PYTHONPATH=. python3 tools/probes/probe_spec_policy.py --out F [--concurrency 1,4,16,32]
       [--rounds 2] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.results import git_info
from protos.splitserve.v1 import common_pb2, decode_pb2_grpc
from rpc.auth import INTERNAL_TOKEN_ENV, bearer_metadata
from tools.probes.probe_disagg import HOST, free_port

MODES = ("off", "ngram", "suffix", "policy")
# Requests per cell at least (a cell of concurrency 1 sends them one after another): fewer
# leave a cell's figure to one request's luck, or to one exploring decision of the policy.
MIN_REQUESTS = 4
_MODE_FLAGS = {"off": ["--speculative-tokens", "0"],
               "ngram": ["--speculative-policy", "always", "--speculative-policy-method", "ngram"],
               "suffix": ["--speculative-policy", "always",
                          "--speculative-policy-method", "suffix"]}

_FUNCTIONS = [
    ("compute_total", "items", "price"), ("average_score", "scores", "weight"),
    ("merge_records", "records", "key"), ("count_words", "lines", "word"),
    ("filter_active", "users", "status"), ("scale_vector", "values", "factor"),
    ("parse_config", "entries", "option"), ("find_largest", "numbers", "limit"),
]
_ANIMALS = ["fox", "owl", "otter", "tiger", "rabbit", "whale", "sparrow", "bear"]
_PLACES = ["a quiet forest", "a busy harbour", "the snowy mountains", "an old library",
           "a desert town", "a floating island", "a deep cave", "a market square"]


def code_prompt(i: int) -> str:
    name, seq, attr = _FUNCTIONS[i % len(_FUNCTIONS)]
    code = (f"def {name}({seq}, threshold=0):\n"
            f"    result = []\n"
            f"    for item in {seq}:\n"
            f"        value = item.{attr} * 2 + {i}\n"
            f"        if value > threshold:\n"
            f"            result.append(value)\n"
            f"        else:\n"
            f"            result.append(threshold)\n"
            f"    total = sum(result)\n"
            f"    return total / max(1, len(result))\n")
    return (f"Here is a Python function:\n\n```python\n{code}```\n\nRewrite it with the "
            f"variable `result` renamed to `out`. Keep everything else the same.\n\n```python\n")


def story_prompt(i: int) -> str:
    return (f"Write short story number {i}. Once upon a time, a young {_ANIMALS[i % len(_ANIMALS)]} "
            f"lived in {_PLACES[(3 * i) % len(_PLACES)]}. One morning")


WORKLOADS = {"code_edits": code_prompt, "stories": story_prompt}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _wait_healthy(port: int, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(f"http://{HOST}:{port}/health"):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a service exited during start-up; see the logs")
        if time.monotonic() > deadline:
            raise RuntimeError("start-up timed out")
        time.sleep(1.0)


async def run_cell(base_url: str, model: str, prompts: list[str], concurrency: int,
                   max_tokens: int) -> tuple[int, float]:
    """The prompts through `/v1/completions`, `concurrency` at a time: (tokens, seconds)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600.0) as client:
        async def one(prompt: str) -> int:
            async with sem:
                r = await client.post(f"{base_url}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True})
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens), time.perf_counter() - start


async def _model_name(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=30.0) as client:
        r = await client.get(f"{base_url}/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


def _decisions(port: int) -> dict[str, float]:
    """The policy gateway's decisions: "method/k/class/reason" -> count."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("splitserve:spec_decode_policy_decisions_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")]
                          .split(","))
            key = "/".join(labels[k].strip('"') for k in
                           ("method", "num_speculative_tokens", "request_class", "reason"))
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


async def _worker_numbers(decode_port: int, token: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(f"{HOST}:{decode_port}") as ch:
        r = await decode_pb2_grpc.DecodeStub(ch).GetLoad(
            common_pb2.LoadRequest(), metadata=bearer_metadata(token), timeout=30)
    names = {common_pb2.SPECULATIVE_METHOD_NGRAM: "ngram",
             common_pb2.SPECULATIVE_METHOD_SUFFIX: "suffix"}
    return {
        "step_cost": [[round(p.rows, 2), round(p.seconds, 5)] for p in r.spec_step_cost],
        "acceptance": [{"method": names.get(a.method, str(a.method)),
                        "request_class": a.request_class, "steps": round(a.steps, 1),
                        "drafted_per_step": [round(d / a.steps, 3) for d in a.drafted],
                        "accepted_per_step": [round(x / a.steps, 3) for x in a.accepted]}
                       for a in r.spec_acceptance if a.steps > 0],
        "spec_num_drafts": r.spec_num_drafts,
        "spec_accepted_tokens_per_pos": list(r.spec_accepted_tokens_per_pos),
    }


async def _worker_counters(decode_port: int, token: str) -> dict[str, float]:
    """The decode worker's cumulative drafting counters, flat: verified drafts (`drafts`:
    verify steps with drafts; `accepted`: drafts accepted), rounds by the drafts its step
    budget allowed (`rounds/method/class/k`) and pauses begun (`pauses/method/class`)."""
    async with grpc.aio.insecure_channel(f"{HOST}:{decode_port}") as ch:
        r = await decode_pb2_grpc.DecodeStub(ch).GetLoad(
            common_pb2.LoadRequest(), metadata=bearer_metadata(token), timeout=30)
    names = {common_pb2.SPECULATIVE_METHOD_NGRAM: "ngram",
             common_pb2.SPECULATIVE_METHOD_SUFFIX: "suffix"}
    out = {"drafts": float(r.spec_num_drafts),
           "accepted": float(sum(r.spec_accepted_tokens_per_pos))}
    for d in r.spec_draft_rounds:
        out[f"rounds/{names.get(d.method, d.method)}/{d.request_class}/"
            f"{d.num_speculative_tokens}"] = float(d.rounds)
    for q in r.spec_pauses:
        out[f"pauses/{names.get(q.method, q.method)}/{q.request_class}"] = float(q.pauses)
    return out


def paired_ratio(runs: dict[str, list[float]], best_other: str) -> dict[str, Any]:
    """The policy's ratio to `best_other` round by round (both ran in the same round, back to
    back), their mean and the mean's standard error (0 with one round)."""
    ratios = [p / b for p, b in zip(runs["policy"], runs[best_other], strict=True) if b > 0]
    n = len(ratios)
    mean = sum(ratios) / n if n else 0.0
    var = sum((r - mean) ** 2 for r in ratios) / (n - 1) if n > 1 else 0.0
    return {"vs": best_other, "by_round": [round(r, 3) for r in ratios],
            "mean": round(mean, 3), "sem": round((var / n) ** 0.5 if n else 0.0, 3)}


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


async def measure(ports: dict[str, int], model: str, concurrency: list[int], rounds: int,
                  max_tokens: int, worker: tuple[int, str],
                  partial: Path | None = None) -> list[dict[str, Any]]:
    """The table's rows; `worker`: the decode worker's port and token, whose drafting counters
    are read around every mode's run (the modes of a round run one after another, so each
    run's difference is its own)."""
    bases = {m: f"http://{HOST}:{p}" for m, p in ports.items()}
    # Warm-up, not recorded: every gateway and workload once (the policy learns here too).
    for make in WORKLOADS.values():
        for mode in MODES:
            await run_cell(bases[mode], model, [make(50 + i) for i in range(4)], 4, max_tokens)
    rows: list[dict[str, Any]] = []
    for wl, make in WORKLOADS.items():
        for c in concurrency:
            n = max(c, MIN_REQUESTS)
            runs: dict[str, list[float]] = {m: [] for m in MODES}
            counters: dict[str, dict[str, float]] = {m: {} for m in MODES}
            decided_before = _decisions(ports["policy"])
            for r in range(rounds):
                shift = (r + len(rows)) % len(MODES)  # each cell and round its own order
                order = MODES[shift:] + MODES[:shift]
                for mode in order:
                    # Prompts of its own for each mode in a round: a mode that ran after
                    # another on the same prompts would find their KV in the prefill worker's
                    # cache (and its outputs in the suffix tree). The sets rotate over the
                    # modes from round to round: some sets are easier to draft for.
                    prompt_set = (MODES.index(mode) + r) % len(MODES)
                    prompts = [make(1000 * prompt_set + 100 * r + i) for i in range(n)]
                    before = await _worker_counters(*worker)
                    tokens, seconds = await run_cell(bases[mode], model, prompts, c, max_tokens)
                    done = _diff(await _worker_counters(*worker), before)
                    for key, count in done.items():
                        counters[mode][key] = counters[mode].get(key, 0.0) + count
                    runs[mode].append(tokens / seconds)
                    print(f"{wl} c={c} round {r} {mode}: {tokens / seconds:.1f} tok/s",
                          flush=True)
            tok_s = {m: round(sum(v) / len(v), 2) for m, v in runs.items()}
            best_mode = max((m for m in MODES if m != "policy"), key=lambda m: tok_s[m])
            rows.append({"workload": wl, "concurrency": c, "requests": n, "tok_s": tok_s,
                         "runs_tok_s": {m: [round(x, 2) for x in v] for m, v in runs.items()},
                         "policy_ratio_vs_best": round(tok_s["policy"] / tok_s[best_mode], 3),
                         "paired": paired_ratio(runs, best_mode),
                         "worker_by_mode": counters,
                         "policy_decisions": _diff(_decisions(ports["policy"]),
                                                   decided_before)})
            if partial is not None:
                partial.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--speculative-config", default="",
                    help="the workers' --speculative-config JSON instead of the suffix/4 flags "
                         "(e.g. to turn the step budget off for an A/B)")
    args = ap.parse_args()
    git = git_info()  # the code that runs: read before the run, not after it
    concurrency = [int(c) for c in args.concurrency.split(",")]
    token = secrets.token_urlsafe(32)
    env = {**os.environ, INTERNAL_TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    ports = {m: free_port() for m in MODES}
    grpc_ports = {m: free_port() for m in MODES}
    prefill_port, decode_port = free_port(), free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="probe_spec_policy_"))
    spec = (["--speculative-config", args.speculative_config] if args.speculative_config
            else ["--speculative-method", "suffix", "--num-speculative-tokens", "4"])
    engine = [*spec, "--max-model-len", "2048", "--max-num-seqs", "32"]
    up = [sys.executable, "-m", "splitserve", "up", "--port", str(ports["policy"]),
          "--grpc-port", str(grpc_ports["policy"]), "--prefill-port", str(prefill_port),
          "--decode-port", str(decode_port), "--log-dir", str(log_dir), *engine]
    procs = [subprocess.Popen(up, env=env, stdout=(log_dir / "up.out").open("wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)]
    try:
        _wait_healthy(ports["policy"], procs, args.startup_timeout)
        model = asyncio.run(_model_name(f"http://{HOST}:{ports['policy']}"))
        for mode, flags in _MODE_FLAGS.items():
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "splitserve", "serve", "--role", "gateway",
                 "--prefill", f"{HOST}:{prefill_port}", "--decode", f"{HOST}:{decode_port}",
                 "--host", HOST, "--port", str(ports[mode]), "--grpc-port",
                 str(grpc_ports[mode]), "--served-model-name", model,
                 "--speculative-tokens", "4", *flags],
                env=env, stdout=(log_dir / f"gateway_{mode}.log").open("wb"),
                stderr=subprocess.STDOUT, start_new_session=True))
        for mode in _MODE_FLAGS:
            _wait_healthy(ports[mode], procs, args.startup_timeout)
        started = time.time()
        load_before = os.getloadavg()
        rows = asyncio.run(measure(ports, model, concurrency, args.rounds, args.max_tokens,
                                   (decode_port, token), Path(args.out + ".partial")))
        load_after = os.getloadavg()
        worker = asyncio.run(_worker_numbers(decode_port, token))
        result = {
            "probe": "spec_policy",
            "command": "PYTHONPATH=. python3 tools/probes/probe_spec_policy.py "
                       f"--out {args.out} --concurrency {args.concurrency} "
                       f"--rounds {args.rounds} --max-tokens {args.max_tokens}"
                       + (f" --speculative-config '{args.speculative_config}'"
                          if args.speculative_config else ""),
            "model": model, "engine_args": engine, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "git": git,
            "notes": ("CPU, 2 cores; other sessions' quick jobs may run at the same time "
                      "(load averages below; the modes are interleaved per round so that "
                      "contention spreads over all of them). Prefill and decode workers get "
                      "one thread each (splitserve up's CPU default)."),
            "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
            "loadavg_1_5_15_after": [round(x, 2) for x in load_after],
            "measure_seconds": round(time.time() - started, 1),
            "rows": rows,
            "worst_policy_ratio_vs_best": min(r["policy_ratio_vs_best"] for r in rows),
            "worst_paired_ratio": min(r["paired"]["mean"] for r in rows),
            "policy_decisions": _decisions(ports["policy"]),
            "decode_worker": worker,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({"worst_policy_ratio_vs_best": result["worst_policy_ratio_vs_best"]}))
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
