"""Merge the suite files of one headline run made in parts, then summarise the merged file.

The lent H200 takes commands of at most 10 minutes, and the whole suite (`tools/gpu/run_h200.sh`,
nine steps) takes about 9: a headline is therefore run as two processes on one machine, one
right after the other, e.g.

    OUT=A SUITE_STEPS=latency_eager,latency_graphs,ttft_4096,throughput_random,concurrent_128,\
hf_baseline_128 bash tools/gpu/run_h200.sh
    python3 tools/gpu/h200_suite.py --out-dir B --steps throughput_random_fp8,throughput_random_int8,\
throughput_random_w8a8_fp8
    python3 tools/gpu/merge_suite.py --out-dir M --kernels A/kernels.json \\
        "A (kernels, bf16 rows, HF; run_h200.sh)=A/suite.json" \\
        "B (one-byte KV and W8A8 rows, h200_suite.py)=B/suite.json"

The parts must come from the same commit, GPU and host and share their sizes; a step may appear
in one part only. `M/suite.json` holds every step, the first part's environment and sizes, and
each part's environment under `parts`; `M/h200_<model>.json` is its summary
(`tools/gpu/summarize_h200.py`), whose commit is the parts' commit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from bench.results import write_json
from tools.gpu.summarize_h200 import summarize

# Environment fields that must agree between the parts of one run (versions may not differ
# either: the parts run from one tree on one machine).
SAME_RUN_FIELDS = ("commit", "hostname", "gpu", "torch", "triton")


class MergeError(ValueError):
    """The parts cannot be one run's."""


def merge(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One suite document from `(label, suite document)` pairs, in order."""
    if len(parts) < 2:
        raise MergeError("give at least two parts")
    labels = [label for label, _ in parts]
    if len(set(labels)) != len(labels):
        raise MergeError(f"part labels must differ: {labels}")
    first_label, first = parts[0]
    for label, doc in parts:
        for key in ("environment", "sizes", "steps"):
            if not isinstance(doc.get(key), dict):
                raise MergeError(f"part {label!r} has no {key!r} object: not a suite file")
    env0 = first["environment"]
    steps: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for label, doc in parts:
        env = doc["environment"]
        for name in SAME_RUN_FIELDS:
            if env.get(name) != env0.get(name):
                raise MergeError(f"{name} differs: {env0.get(name)!r} in {first_label!r}, "
                                 f"{env.get(name)!r} in {label!r}")
        if doc["sizes"] != first["sizes"]:
            diff = sorted(k for k in set(doc["sizes"]) | set(first["sizes"])
                          if doc["sizes"].get(k) != first["sizes"].get(k))
            raise MergeError(f"sizes differ between {first_label!r} and {label!r}: {diff}")
        for name, entry in doc["steps"].items():
            if name in steps:
                raise MergeError(f"step {name!r} is in {owner[name]!r} and in {label!r}")
            steps[name], owner[name] = entry, label
    return {"environment": env0, "sizes": first["sizes"], "steps": steps,
            "parts": {label: doc["environment"] for label, doc in parts}}


def _part(arg: str) -> tuple[str, dict[str, Any]]:
    label, sep, path = arg.rpartition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {arg!r}")
    try:
        return label, json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{path}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", type=_part, metavar="LABEL=SUITE_JSON")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--kernels", help="the run's kernels.json, copied beside the merged suite")
    p.add_argument("--model", default="llama-3.1-8b")
    args = p.parse_args(argv)
    try:
        merged = merge(args.parts)
    except MergeError as e:
        print(f"merge_suite: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    write_json(out_dir / "suite.json", merged)
    if args.kernels:
        shutil.copyfile(args.kernels, out_dir / "kernels.json")
    env = merged["environment"]
    doc = summarize(out_dir, args.model, commit=env.get("commit"), dirty=env.get("dirty"))
    path = write_json(out_dir / f"h200_{args.model}.json", doc)
    print(f"merged {len(merged['steps'])} steps of {len(args.parts)} parts; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
