"""`Fp8Linear` on the GPU against the arithmetic it stands for, eager and in a CUDA graph.

For the Llama-3.1-8B projection shapes and batch rows 1..4096: y must equal
(q_x * s_x) @ (q_w * s_w)^T computed in float32 from the same quantized operands, up to the
bf16 rounding of y; and the first row computed alone (the batch-1 GEMV, a decode step) must
equal that row of the batched call (cuBLASLt, a prefill) to the same rounding: one definition
of W8A8 on every path. Usage: PYTHONPATH=. python3 tools/gpu/fp8_linear_check.py --out $OUT/x.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from engine.kernels import per_token_quant_fp8
from engine.model.quant import Fp8Linear, quantize_weight_fp8

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 8, 64, 4096)
MAX_REL_ERR = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out: list[dict[str, object]] = []
    for name, (n, k) in SHAPES.items():
        linear = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(0.0, 0.02, generator=gen)
        layer = Fp8Linear(linear, use_triton=True)
        wq, ws = quantize_weight_fp8(linear.weight.detach())
        w_deq = wq.float() * ws[:, None]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            xq, xs = per_token_quant_fp8(x)
            want = (xq.float() * xs) @ w_deq.t()
            eager = layer(x)
            out = torch.empty_like(eager)
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out.copy_(layer(x))
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                out.copy_(layer(x))
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            err_eager, err_graph = _rel(eager, want), _rel(out, want)
            err_row = _rel(layer(x[:1]), eager[:1])
            row = {"shape": name, "rows": m, "rel_err_eager": err_eager,
                   "rel_err_graph": err_graph, "rel_err_row_alone_vs_batch": err_row,
                   "rel_err_vs_bf16": _rel(eager, linear(x)),
                   "ok": max(err_eager, err_graph, err_row) < MAX_REL_ERR}
            rows_out.append(row)
            print(row, flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "rows": rows_out,
           "ok": all(r["ok"] for r in rows_out)}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("fp8 linear check:", "OK" if doc["ok"] else "MISMATCH")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
