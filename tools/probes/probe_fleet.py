"""Output tokens/s of a fleet on CPU: 1 prefill + 1 decode worker (1P1D) against 2 + 2 (2P2D),
one gateway in front, the same client concurrency, rounds interleaved (A, B, A, B, ...) so that
a change in the machine's other load hits both layouts alike.

Every process is real: workers as `python -m prefill_service` / `python -m decode_service`
(the embedded SmolLM2-135M unless --model), each with --cpu-threads 1, the gateway as
`python -m gateway` with static loopback addresses, and `splitserve bench online` as the
client (completions, streamed, EOS ignored, random prompts).

Usage: PYTHONPATH=. python3 tools/probes/probe_fleet.py --out bench/results/cpu_fleet.json
       [--rounds 2] [--num-prompts 24] [--input-len 128] [--output-len 32] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.results import git_info
from rpc.auth import INTERNAL_TOKEN_ENV

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a process exited while starting"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


def run_layout(pools: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start `pools` prefill + `pools` decode workers and a gateway, run the client once."""
    env = {**os.environ, INTERNAL_TOKEN_ENV: secrets.token_hex(16),
           "PYTHONPATH": str(ROOT)}
    engine = ["--cpu-threads", "1", "--num-gpu-blocks", "512", "--max-model-len", "1024",
              "--log-level", "warning", *(["--model", args.model] if args.model else [])]
    procs: list[subprocess.Popen[bytes]] = []
    prefill, decode = [], []
    try:
        for i in range(pools):
            p, d = free_port(), free_port()
            prefill.append(f"{HOST}:{p}")
            decode.append(f"{HOST}:{d}")
            procs.append(start(["-m", "prefill_service", "--port", str(p), *engine], env,
                               workdir / f"prefill{pools}_{i}.log"))
            procs.append(start(["-m", "decode_service", "--port", str(d), *engine], env,
                               workdir / f"decode{pools}_{i}.log"))
        rest = free_port()
        procs.append(start(["-m", "gateway", "--host", HOST, "--port", str(rest), "--grpc-port",
                            str(free_port()), "--prefill", ",".join(prefill), "--decode",
                            ",".join(decode), "--log-level", "warning",
                            *(["--model", args.model] if args.model else [])],
                           env, workdir / f"gateway{pools}.log"))
        wait_healthy(f"http://{HOST}:{rest}/health", procs, 600)
        out = workdir / f"client{pools}.json"
        subprocess.run([sys.executable, "-m", "splitserve", "bench", "online", "--base-url",
                        f"http://{HOST}:{rest}", "--num-prompts", str(args.num_prompts),
                        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--max-concurrency", str(args.concurrency), "--total-timeout", "900",
                        "--vocab-size", str(args.vocab_size),
                        "--out", str(out)], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL, timeout=1000)
        metrics = json.loads(out.read_text())["metrics"]
        assert metrics["failed"] == 0, metrics
        return {"output_throughput": metrics["output_throughput"],
                "completed": metrics["completed"], "duration_s": metrics["duration_s"]}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="random prompts' token ids stay below it (SmolLM2's vocabulary)")
    args = p.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"1p1d": [], "2p2d": []}
    with tempfile.TemporaryDirectory(prefix="probe_fleet_") as tmp:
        for _ in range(args.rounds):
            for pools, key in ((1, "1p1d"), (2, "2p2d")):
                runs[key].append(run_layout(pools, args, Path(tmp)))
                print(key, runs[key][-1], flush=True)
    tok_s = {k: statistics.median(r["output_throughput"] for r in v) for k, v in runs.items()}
    result = {
        "tok_s_1p1d": round(tok_s["1p1d"], 2),
        "tok_s_2p2d": round(tok_s["2p2d"], 2),
        "ratio_2p2d_vs_1p1d": round(tok_s["2p2d"] / tok_s["1p1d"], 3),
        "command": "PYTHONPATH=. python3 tools/probes/probe_fleet.py --out "
                   f"bench/results/cpu_fleet.json --rounds {args.rounds} --num-prompts "
                   f"{args.num_prompts} --input-len {args.input_len} --output-len "
                   f"{args.output_len} --concurrency {args.concurrency}",
        "runs": runs,
        "setup": {"model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
                  "cpu_threads_per_worker": 1, "client_concurrency": args.concurrency,
                  "cpus": os.cpu_count(), "rounds_interleaved": args.rounds},
        "git": git_info(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("tok_s_1p1d", "tok_s_2p2d",
                                             "ratio_2p2d_vs_1p1d")}))


if __name__ == "__main__":
    main()
