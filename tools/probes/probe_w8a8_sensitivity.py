"""Where FP8 W8A8's perplexity loss comes from: the same real-text perplexity as
tools/probes/probe_quant_ppl.py, with W8A8 applied to a part of the model at a time.

One unquantized engine; its decoder projections are swapped in place for `Fp8Linear` (the
engine's own W8A8 layer, torch path) for each subset, scored, and put back. Subsets: every
projection (the engine's `--quantization fp8`); fp8 weights alone (e4m3 per-channel weights,
dequantized, activations unquantized); fp8 activations alone (each row quantized per token and
dequantized, weights unquantized); per-tensor scales instead of per-channel / per-token (vLLM's
online `--quantization fp8`); one projection kind across all layers; one layer at a time
(`--per-layer`); all layers but the first and the last. `perplexity_noise`: the whole-model
W8A8 perplexity again with the input embeddings scaled by 1 ± k·2^-22 (a change in the last bits
of every input), the spread a W8A8 perplexity figure carries from float32 rounding alone.

Usage: PYTHONPATH=. python3 tools/probes/probe_w8a8_sensitivity.py --out F [--text FILE ...]
       [--window 256] [--per-layer] [--noise-samples 4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.results import git_info
from engine.kernels.reference import per_token_quant_fp8_ref
from engine.model.quant import Fp8Linear, _linears_to_swap, quantize_weight_fp8
from tools.probes.probe_quant_ppl import (
    DEFAULT_TEXTS,
    nudged_embeddings,
    read_text,
    score,
    windows,
    write_doc,
)


class Fp8WeightsOnly(nn.Module):
    """x W'^T (+ b) with W' the e4m3 per-channel weight dequantized: the weights' share."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_weight_fp8(linear.weight.detach())
        self.weight = nn.Parameter((q.float() * scale[:, None]).to(linear.weight.dtype),
                                   requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class Fp8ActivationsOnly(nn.Module):
    """The original linear over each row quantized per token to e4m3 and dequantized."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = per_token_quant_fp8_ref(x.reshape(-1, x.shape[-1]))
        return self.linear((q.float() * scale).to(x.dtype).reshape(x.shape))


class Fp8PerTensor(nn.Module):
    """vLLM's online `--quantization fp8` scheme for comparison: one scale for the whole weight
    and one for the whole input of each call (dynamic, per tensor), dequantized products."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = per_token_quant_fp8_ref(linear.weight.detach().reshape(1, -1))
        self.weight = nn.Parameter((q.float() * scale).reshape(linear.weight.shape),
                                   requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = per_token_quant_fp8_ref(x.reshape(1, -1))
        return nn.functional.linear((q.float() * scale).to(x.dtype).reshape(x.shape),
                                    self.weight, self.bias)


Make = Callable[[nn.Linear], nn.Module]
Chosen = Callable[[str], bool]


def w8a8(linear: nn.Linear) -> nn.Module:
    """The engine's own W8A8 layer on the torch path."""
    return Fp8Linear(linear, False)


def only(suffix: str = "", prefix: str = "") -> Chosen:
    """The projections whose path ends with `suffix` and starts with `prefix`."""
    return lambda path: path.endswith(suffix) and path.startswith(prefix)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="")
    p.add_argument("--text", action="append", default=None)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--per-layer", action="store_true", help="also W8A8 on one layer at a time")
    p.add_argument("--noise-samples", type=int, default=4,
                   help="last-bit nudges of the whole-model W8A8 run (half up, half down)")
    args = p.parse_args(argv)
    from engine.llm import LLM

    start = time.perf_counter()
    torch.set_grad_enabled(False)
    llm = LLM(model=args.model, device="cpu", dtype="float32", num_gpu_blocks=256,
              enable_prefix_caching=False, max_model_len=max(512, args.window))
    runner = llm.engine.runner
    model = runner.model
    texts_in = args.text or list(DEFAULT_TEXTS)
    tok = llm.get_tokenizer()
    texts = [w for t in texts_in for w in windows(tok.encode(read_text(t)), args.window)]
    ref = [runner.prefill_logits(ids) for ids in texts]
    base = score(ref, texts, None)["perplexity"]
    swaps = _linears_to_swap(model)
    path_of = {(id(m), name): f"{prefix}.{name}" for prefix, m in model.named_modules()
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}

    def run(chosen: Chosen, make: Make = w8a8) -> dict[str, Any]:
        picked = [(m, n, lin) for m, n, lin in swaps if chosen(path_of[(id(m), n)])]
        for m, n, lin in picked:
            setattr(m, n, make(lin))
        try:
            logits = [runner.prefill_logits(ids) for ids in texts]
        finally:
            for m, n, lin in picked:
                setattr(m, n, lin)
        row = score(logits, texts, ref)
        row["perplexity_change"] = row["perplexity"] / base - 1.0
        row["projections"] = len(picked)
        return row

    n_layers = len(model.layers)
    edges = ("layers.0.", f"layers.{n_layers - 1}.")
    subsets: dict[str, tuple[Chosen, Make]] = {
        "w8a8_all": (only(), w8a8),
        "fp8_weights_only": (only(), Fp8WeightsOnly),
        "fp8_activations_only": (only(), Fp8ActivationsOnly),
        "w8a8_per_tensor_scales": (only(), Fp8PerTensor),
        **{f"only_{k}": (only(suffix=k), w8a8)
           for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")},
        "all_but_first_and_last_layer": (lambda path: not path.startswith(edges), w8a8),
    }
    if args.per_layer:
        subsets.update({f"only_layer_{i}": (only(prefix=f"layers.{i}."), w8a8)
                        for i in range(n_layers)})
    doc: dict[str, Any] = {**git_info(), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
                           "device": "cpu", "dtype": "float32", "texts": texts_in,
                           "window": args.window, "windows": len(texts),
                           "tokens_scored": score(ref, texts, None)["tokens_scored"],
                           "unquantized_perplexity": base, "subsets": {}}
    for name, (chosen, make) in subsets.items():
        doc["subsets"][name] = run(chosen, make)
        print(name, {k: round(v, 4) for k, v in doc["subsets"][name].items()}, flush=True)
    noise = []
    for k in range(args.noise_samples):
        factor = 1.0 + (k // 2 + 1) * (-1) ** k * 2.0 ** -22
        with nudged_embeddings(llm, factor):
            noise.append(run(only())["perplexity_change"])
    if noise:
        doc["perplexity_noise"] = {"w8a8_all_changes": noise, "min": min(noise),
                                   "max": max(noise)}
        print("noise", doc["perplexity_noise"], flush=True)
    llm.shutdown()
    write_doc(args.out, doc, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
