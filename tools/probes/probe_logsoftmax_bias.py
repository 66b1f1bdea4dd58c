"""How far float32 log-probabilities are from float64 ones (CPU): torch's `log_softmax` against
`logits - logsumexp(logits)` (what prompt scoring computes, engine/kernels/reference.py
`score_rows_ref`), on random rows of a SmolLM2-sized vocabulary.

Usage: PYTHONPATH=. python3 tools/probes/probe_logsoftmax_bias.py --out F [--rows 2000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.results import cpu_name, git_info
from engine.kernels.reference import score_rows_ref


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--vocab", type=int, default=49152)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen) * 4 + 5
    targets = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    exact = logits.double().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    ways = {"log_softmax_float32": logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1),
            "logsumexp_float32": score_rows_ref(logits, targets)[0]}
    results = {name: {"mean_error": (got.double() - exact).mean().item(),
                      "mean_abs_error": (got.double() - exact).abs().mean().item(),
                      "max_abs_error": (got.double() - exact).abs().max().item()}
               for name, got in ways.items()}
    doc = {**git_info(), "cpu": cpu_name(), "torch": torch.__version__, "rows": args.rows,
           "vocab": args.vocab, "results": results,
           "command": "PYTHONPATH=. python3 tools/probes/probe_logsoftmax_bias.py --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
