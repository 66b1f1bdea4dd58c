"""How an int8 KV cache's per-channel factors fare under the GPU decode kernel's int8 QK dot,
emulated on the CPU.

One prefill of the first `--tokens` tokens of a text through the unquantized model records
each layer's rotated q and k. Per layer, the attention scores q.k are compared with four
approximations (relative L2 error over every head, query and key):

    layer_fp_q      K in int8 under the layer's scale, q exact (the fp16 QK path, no factors)
    channel_fp_q    K / f in int8, q * f exact (the fp16 QK path with factors)
    layer_int8_q    K as layer_fp_q, q rounded per row to int8 (the int8 QK dot, no factors)
    channel_int8_q  K as channel_fp_q, q * f rounded per row to int8 (int8 QK with factors)

The scales and factors are the engine's own (calibrated on its calibration prompt). The int8
QK dot rounds each row of q with one scale (`int8_scaled_q` in engine/kernels/_attention_tile.py),
so q * f's outlier channels coarsen its other channels: what `kv_channels.qk_dot_on_int8`
decides from.

Usage: PYTHONPATH=. python3 tools/probes/probe_kv_qk_int8.py --out F [--model GGUF]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import torch

DEFAULT_TEXT = "bench/data/public_domain_sample.txt"


def q_int8(x: torch.Tensor) -> torch.Tensor:
    """x rounded per row (last dim) to int8 under its row's largest |value| / 127, back in float."""
    from engine.attention.kv_quant import quantize_int8

    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return quantize_int8(x, scale).float() * scale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args(argv)
    from engine.attention.kv_calibration import calibration_token_ids, round_scales
    from engine.attention.kv_channels import channel_factors, layer_amax
    from engine.attention.kv_quant import quantize_int8, scales_from_amax
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.llm import LLM

    llm = LLM(model=args.model, device="cpu", num_gpu_blocks=64, enable_prefix_caching=False,
              max_model_len=1024)
    runner = llm.engine.runner
    cfg = runner.model_config
    tok = llm.get_tokenizer()
    if tok is None:
        raise SystemExit("the model needs a tokenizer")
    amax = runner.measure_kv_amax(calibration_token_ids(tok, cfg.vocab_size))
    factors = channel_factors(amax)
    scales = round_scales(scales_from_amax(layer_amax(amax), torch.int8))
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    write_kv = TorchAttentionBackend.write_kv

    def spy(self: TorchAttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            *rest: Any, **kw: Any) -> None:
        captured.append((q.detach().float().clone(), k.detach().float().clone()))
        write_kv(self, q, k, v, *rest, **kw)

    TorchAttentionBackend.write_kv = spy  # type: ignore[method-assign]
    try:
        ids = tok.encode(Path(args.text).read_text())[:args.tokens]
        runner.prefill_logits(ids)
    finally:
        TorchAttentionBackend.write_kv = write_kv  # type: ignore[method-assign]
    names = ("layer_fp_q", "channel_fp_q", "layer_int8_q", "channel_int8_q")
    per_layer = []
    for i, (q, k) in enumerate(captured[-cfg.num_hidden_layers:]):
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, 1)                  # [T, H, D]
        f = factors[i, 0].repeat_interleave(group, 0)      # [H, D]
        s = float(scales[i, 0])
        k_layer = quantize_int8(k, s).float() * s
        k_channel = quantize_int8(k / f, s).float() * s    # the stored K / f, dequantized
        exact = torch.einsum("thd,shd->ths", q, k)
        approx = (torch.einsum("thd,shd->ths", q, k_layer),
                  torch.einsum("thd,shd->ths", q * f, k_channel),
                  torch.einsum("thd,shd->ths", q_int8(q), k_layer),
                  torch.einsum("thd,shd->ths", q_int8(q * f), k_channel))
        norm = exact.norm()
        per_layer.append({n: float((a - exact).norm() / norm) for n, a in zip(names, approx,
                                                                              strict=True)})
    mean = {n: sum(r[n] for r in per_layer) / len(per_layer) for n in names}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    result = {"commit": commit, "model": args.model or "SmolLM2-135M-Instruct (embedded)",
              "text": args.text, "tokens": len(ids), "head_dim": cfg.head_dim,
              "score_error_mean": mean, "score_error_per_layer": per_layer}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(mean))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
