"""Compare two lm-eval runs sample by sample (their `--log_samples` output): every
log-likelihood one run computed against the other's, per task, with the tasks' metrics.

Made to check splitserve's scoring (`local-completions` against the server: `echo` with
`logprobs`, the remote tokenizer) against lm-eval's own `hf` backend on the same weights
(tools/lm_eval/README.md has the commands).

Usage: python3 tools/compare_lm_eval.py --a DIR --b DIR --out F [--names server,hf]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_SAMPLES = re.compile(r"samples_(?P<task>.+)_\d{4}-\d{2}-\d{2}T[\d.-]+\.jsonl")


def load_samples(folder: Path) -> dict[str, dict[int, list[tuple[float, bool | None]]]]:
    """task -> doc id -> its requests' (log-likelihood, is_greedy or None for rolling ones)."""
    out: dict[str, dict[int, list[tuple[float, bool | None]]]] = {}
    for path in folder.rglob("samples_*.jsonl"):
        match = _SAMPLES.fullmatch(path.name)
        if match is None:
            continue
        docs = out.setdefault(match["task"], {})
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            docs[int(sample["doc_id"])] = [_response(r) for r in sample["filtered_resps"]]
    return out


def _response(resp: Any) -> tuple[float, bool | None]:
    """[ll, is_greedy] of a log-likelihood request, or ll alone (a rolling one)."""
    if isinstance(resp, list):
        return float(resp[0]), str(resp[1]) == "True"
    return float(resp), None


def load_metrics(folder: Path) -> dict[str, dict[str, Any]]:
    paths = sorted(folder.rglob("results_*.json"))
    if not paths:
        return {}
    return {task: {k: v for k, v in values.items() if k != "alias"}
            for task, values in json.loads(paths[-1].read_text())["results"].items()}


def compare(a: dict[str, dict[int, list[tuple[float, bool | None]]]],
            b: dict[str, dict[int, list[tuple[float, bool | None]]]]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for task in sorted(set(a) | set(b)):
        docs_a, docs_b = a.get(task, {}), b.get(task, {})
        if set(docs_a) != set(docs_b):
            report[task] = {"error": f"doc ids differ: {sorted(set(docs_a) ^ set(docs_b))[:10]}"}
            continue
        diffs: list[float] = []
        greedy_same = greedy_total = 0
        for doc in docs_a:
            ra, rb = docs_a[doc], docs_b[doc]
            if len(ra) != len(rb):
                raise ValueError(f"{task} doc {doc}: {len(ra)} against {len(rb)} requests")
            for (lla, ga), (llb, gb) in zip(ra, rb, strict=True):
                diffs.append(abs(lla - llb))
                if ga is not None:
                    greedy_total += 1
                    greedy_same += ga == gb
        report[task] = {"docs": len(docs_a), "loglikelihoods": len(diffs),
                        "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
                        "is_greedy_agree": f"{greedy_same}/{greedy_total}"}
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--a", required=True, type=Path)
    p.add_argument("--b", required=True, type=Path)
    p.add_argument("--names", default="a,b")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    name_a, name_b = args.names.split(",")
    doc = {"compared": {name_a: str(args.a), name_b: str(args.b)},
           "samples": compare(load_samples(args.a), load_samples(args.b)),
           "metrics": {name_a: load_metrics(args.a), name_b: load_metrics(args.b)}}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["samples"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
