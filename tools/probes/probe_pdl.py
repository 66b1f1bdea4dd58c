"""Batch-1 decode layers with and without the fused-norm GEMV and programmatic dependent launch
(run on the H200).

The 32 layers of a Llama-3.1-8B decode step at batch 1, without attention (its input is the
QKV output's first 4096 features), captured in one CUDA graph, three ways:

- `cublas`: what the default model runs: RMSNorm kernel, `F.linear` QKV, O, RMSNorm, gate/up,
  SiLU-and-mul kernel, down (cuBLAS with its split-K reduces);
- `gemv`: RMSNorm folded into the QKV and gate/up GEMVs, SiLU fused, O and down as GEMVs
  (`SPLITSERVE_GEMV=1`), launched plainly;
- `gemv_pdl`: the same kernels launched with PDL (`SPLITSERVE_PDL=1`).

Reports the median replay time, the weight bytes streamed per ms, and the largest difference of
the final hidden state between the three (gemv vs gemv_pdl must be bit-identical: same
kernels). Every layer has its own weights (14 GB), so L2 never holds them.

With `--sweep`, also times every tile choice of the GEMV kernel at the four shapes as the
model calls them (norm-fused QKV and gate/up, plain O and down), 32 calls with distinct weights
per graph, and reports the best few per shape next to the current choice.

Usage: PYTHONPATH=. python3 tools/probes/probe_pdl.py --out $OUT/probe_pdl.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from bench.results import environment_info
from engine.kernels import gemv as gemv_mod
from engine.kernels import rms_norm, silu_and_mul
from engine.kernels._pdl import pdl_requested, use_pdl
from engine.kernels.gemv import GemvTiles, gemv, rms_norm_gemv
from tools.probes.probe_bs1 import graph_replay_ms

LAYERS = 32
HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
EPS = 1e-5


def make_layers(dev: torch.device) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5

    return [{"qkv": w(Q + 2 * KV, HIDDEN), "o": w(HIDDEN, Q), "gate_up": w(2 * INTER, HIDDEN),
             "down": w(HIDDEN, INTER),
             "ln1": 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16),
             "ln2": 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)}
            for _ in range(LAYERS)]


def run_cublas(layers: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    h, res = x, x.clone()
    for lw in layers:
        a, res = rms_norm(h, lw["ln1"], EPS, res)  # type: ignore[misc]
        qkv = F.linear(a, lw["qkv"])
        h = F.linear(qkv[:, :Q], lw["o"])
        a, res = rms_norm(h, lw["ln2"], EPS, res)  # type: ignore[misc]
        h = F.linear(silu_and_mul(F.linear(a, lw["gate_up"])), lw["down"])
    return h + res


def run_gemv(layers: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    h, res = x, x.clone()
    for lw in layers:
        qkv, res = rms_norm_gemv(h, lw["ln1"], EPS, lw["qkv"], residual=res)
        h = gemv(qkv[:, :Q], lw["o"])
        act, res = rms_norm_gemv(h, lw["ln2"], EPS, lw["gate_up"], residual=res, gated=True)
        h = gemv(act, lw["down"])
    return h + res


def check_fused(layers: list[dict[str, torch.Tensor]], x: torch.Tensor) -> dict[str, Any]:
    """`rms_norm_gemv` at the QKV and gate/up shapes vs the float32 norm-then-matmul, as the
    largest difference relative to the largest output."""
    lw = layers[0]
    res = torch.randn_like(x)
    h = x.float() + res.float()
    a = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * lw["ln1"].float()
    out: dict[str, Any] = {}
    for name, gated in (("qkv", False), ("gate_up", True)):
        y = a @ lw[name].float().T
        want = F.silu(y[:, :INTER]) * y[:, INTER:] if gated else y
        got, new_res = rms_norm_gemv(x, lw["ln1"], EPS, lw[name], residual=res, gated=gated)
        out[name] = {"rel_max_diff": ((got.float() - want).abs().max()
                                      / want.abs().max()).item(),
                     "residual_exact": bool(torch.equal(new_res, h.to(torch.bfloat16)))}
    return out


SWEEP = [GemvTiles(bn, bk, w, st) for bn, bk, w, st in itertools.product(
    (4, 8, 16), (256, 512, 1024), (4, 8), (3, 4)) if bn * bk <= 8192]


def _as_list(t: GemvTiles) -> list[int]:
    return [t.block_n, t.block_k, t.num_warps, t.num_stages]


def sweep_shape(layers: list[dict[str, torch.Tensor]], x: torch.Tensor, name: str
                ) -> dict[str, Any]:
    """Every tile choice in SWEEP for one of the model's four batch-1 calls."""
    k = INTER if name == "down" else HIDDEN
    xin = torch.randn(1, k, device=x.device, dtype=torch.bfloat16)
    res = torch.randn(1, HIDDEN, device=x.device, dtype=torch.bfloat16)

    def calls() -> None:
        for lw in layers:
            if name in ("qkv", "gate_up"):
                rms_norm_gemv(xin, lw["ln1"], EPS, lw[name], residual=res,
                              gated=name == "gate_up")
            else:
                gemv(xin, lw[name])

    rows = layers[0][name].shape[0]
    n = rows // 2 if name == "gate_up" else rows
    current = gemv_mod.choose_gemv_tiles(n, k, name == "gate_up")
    nbytes = sum(lw[name].numel() * 2 for lw in layers)
    original = gemv_mod.choose_gemv_tiles
    timed: list[dict[str, Any]] = []
    try:
        for tiles in SWEEP:
            gemv_mod.choose_gemv_tiles = lambda *_a, t=tiles: t  # type: ignore[assignment]
            try:
                ms = graph_replay_ms(calls, reps=10)
            except Exception as e:  # a tile the compiler refuses is reported, not fatal
                timed.append({"tiles": _as_list(tiles), "error": repr(e)[:200]})
                continue
            timed.append({"tiles": _as_list(tiles), "us_per_call": ms * 1e3 / LAYERS,
                          "tb_s": nbytes / ms / 1e9, "current": tiles == current})
    finally:
        gemv_mod.choose_gemv_tiles = original  # type: ignore[assignment]
    ok = sorted((t for t in timed if "us_per_call" in t), key=lambda t: t["us_per_call"])
    return {"n": n, "k": k, "current": [t for t in ok if t["current"]], "best": ok[:6],
            "errors": [t for t in timed if "error" in t]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also sweep the GEMV tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = make_layers(dev)
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    weight_bytes = sum(lw[k].numel() * 2 for lw in layers for k in ("qkv", "o", "gate_up", "down"))
    variants: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
        "cublas": ("0", run_cublas), "gemv": ("0", run_gemv), "gemv_pdl": ("1", run_gemv)}
    results: dict[str, Any] = {}
    for pdl in ("0", "1"):
        os.environ["SPLITSERVE_PDL"] = pdl
        pdl_requested.cache_clear()
        results[f"fused_check_pdl{pdl}"] = check_fused(layers, x)
    outs: dict[str, torch.Tensor] = {}
    for name, (pdl, fn) in variants.items():
        os.environ["SPLITSERVE_PDL"] = pdl
        pdl_requested.cache_clear()
        holder: dict[str, torch.Tensor] = {}

        def step(f: Callable[..., torch.Tensor] = fn, hold: dict[str, torch.Tensor] = holder
                 ) -> None:
            hold["y"] = f(layers, x)

        ms = graph_replay_ms(step, reps=args.reps)
        outs[name] = holder["y"].float().clone()
        results[name] = {"pdl": use_pdl(dev), "ms": ms, "weight_tb_s": weight_bytes / ms / 1e9}
        print(name, results[name], flush=True)
    eager = run_gemv(layers, x).float()  # PDL still as the last variant left it
    ref = outs["cublas"]
    scale = ref.abs().max().item()
    results["max_abs_diff_vs_cublas"] = {
        k: (v - ref).abs().max().item() for k, v in outs.items() if k != "cublas"}
    results["ref_max_abs"] = scale
    results["gemv_pdl_bit_identical_to_gemv"] = bool(torch.equal(outs["gemv"], outs["gemv_pdl"]))
    results["graph_bit_identical_to_eager"] = bool(torch.equal(outs["gemv_pdl"], eager))
    results["weight_gb"] = weight_bytes / 1e9
    if args.sweep:
        os.environ["SPLITSERVE_PDL"] = "0"
        pdl_requested.cache_clear()
        results["sweep"] = {}
        for name in ("qkv", "o", "gate_up", "down"):
            results["sweep"][name] = sweep_shape(layers, x, name)
            print(name, json.dumps(results["sweep"][name]["current"]),
                  json.dumps(results["sweep"][name]["best"][:3]), flush=True)
    payload = {"environment": environment_info(), "probe_pdl": results}
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
