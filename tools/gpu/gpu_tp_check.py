"""Tensor parallelism on a GPU: the model split over two ranks against one process, on a host
with one GPU (both ranks on it, the group on Gloo: `SPLITSERVE_TP_ONE_DEVICE=1`).

Checks the split's numerics through the GPU path — Triton attention on each rank's heads, the
batch-1 GEMV on sharded weights, the all-reduces, KV blocks gathered from the ranks — not its
speed (Gloo's collectives go through the host). A random Llama checkpoint of a real layout
(16 heads over 8 KV heads, GQA) is written first, so both engines load the same weights.

Usage: PYTHONPATH=. python3 tools/gpu/gpu_tp_check.py --out $OUT/tp_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

from engine import LLM, SamplingParams


def write_checkpoint(path: Path, seed: int, std: float = 0.05) -> None:
    """A random Llama checkpoint (hidden 1,024, 16 heads over 8 KV heads, 4 layers), bf16,
    written by `transformers`; weights but the norms ~ N(0, std)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                      max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    cast(Any, model).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def run(path: Path, tp: int, dtype: str, prompts: list[list[int]], max_tokens: int,
        device: str, adapter: str | None = None) -> dict[str, Any]:
    """`adapter`: a LoRA adapter every other prompt runs (the split's shares of it)."""
    llm = LLM(str(path), dtype=dtype, tensor_parallel_size=tp, num_gpu_blocks=4096,
              max_model_len=2048, max_num_seqs=16, device=device,
              lora_modules={"ad": adapter} if adapter else None)
    try:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True),
                            lora_request=[("ad" if adapter and i % 2 else None)
                                          for i in range(len(prompts))])
        gen_s = time.perf_counter() - t0
        runner = llm.engine.runner
        logits = runner.prefill_logits(prompts[0]).float()
        # The first prompt's full blocks, as the cache holds them after a one-token request.
        llm.engine.add_request("kv", prompts[0], SamplingParams(temperature=0.0, max_tokens=2))
        llm.engine.step()
        blocks = runner.read_blocks(llm.engine.kv.block_ids("kv")[:8]).float()
        return {"tokens": [o.outputs[0].token_ids for o in outs], "logits": logits,
                "blocks": blocks, "generate_s": round(gen_s, 2),
                "backend": runner.backend.name, "cuda_graphs": runner.result.cuda_graphs,
                "shard_heads": runner.shard_config.num_attention_heads}
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def compare(one: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    same_prefix = []
    for a, b in zip(one["tokens"], two["tokens"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same_prefix.append(n)
    la, lb = one["logits"], two["logits"]
    return {
        "sequences_identical": sum(a == b for a, b in zip(one["tokens"], two["tokens"],
                                                          strict=True)),
        "sequences": len(one["tokens"]),
        "tokens_before_first_divergence": same_prefix,
        "prefill_logits_max_abs_diff": float((la - lb).abs().max()),
        "prefill_logits_scale": float(la.abs().max()),
        "prefill_argmax_agreement": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
        "kv_blocks_shape": list(one["blocks"].shape),
        "kv_blocks_max_abs_diff": float((one["blocks"] - two["blocks"]).abs().max()),
        "kv_blocks_scale": float(one["blocks"].abs().max()),
        "tp1": {k: one[k] for k in ("generate_s", "backend", "cuda_graphs", "shard_heads")},
        "tp2": {k: two[k] for k in ("generate_s", "backend", "cuda_graphs", "shard_heads")},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    p.add_argument("--lora", action="store_true",
                   help="also float32 with a LoRA adapter on every other prompt")
    args = p.parse_args()
    os.environ["SPLITSERVE_TP_ONE_DEVICE"] = "1"
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(rng.randrange(64, 600))]
               for _ in range(args.num_prompts)]
    doc: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "",
                           "commit": os.environ.get("SPLITSERVE_COMMIT", ""),
                           "torch": torch.__version__, "num_prompts": len(prompts),
                           "max_tokens": args.max_tokens, "results": {}}
    with contextlib.suppress(OSError):
        doc["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                           text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        write_checkpoint(path, seed=0)
        exact: torch.Tensor | None = None  # one process's float32 prefill logits
        for dtype in args.dtypes.split(","):
            try:
                one = run(path, 1, dtype, prompts, args.max_tokens, args.device)
                two = run(path, 2, dtype, prompts, args.max_tokens, args.device)
                doc["results"][dtype] = compare(one, two)
                if dtype == "float32":
                    exact = one["logits"]
                elif exact is not None:
                    # How far each is from float32: the split's rounding against the dtype's.
                    doc["results"][dtype]["against_float32"] = {
                        f"tp{n}": {"max_abs_diff": float((r["logits"] - exact).abs().max()),
                                   "argmax_agreement": float(
                                       (r["logits"].argmax(-1) == exact.argmax(-1))
                                       .float().mean())}
                        for n, r in ((1, one), (2, two))}
            except Exception as e:  # recorded, the other dtype still runs
                doc["results"][dtype] = {"error": f"{type(e).__name__}: {e}"}
            print(dtype, json.dumps(doc["results"][dtype])[:1200], flush=True)
        if args.lora:
            from engine.config import LoadConfig
            from engine.loader import load_model_source
            from engine.lora.adapter import ATTENTION_TARGETS, MLP_TARGETS
            from tools.gpu.gpu_lora_check import write_adapter

            cfg = load_model_source(LoadConfig(model=str(path))).config
            adapter = Path(tmp) / "adapter"
            write_adapter(adapter, cfg, ATTENTION_TARGETS + MLP_TARGETS, 8, 16, 4, 0.03)
            try:
                one = run(path, 1, "float32", prompts, args.max_tokens, args.device, str(adapter))
                two = run(path, 2, "float32", prompts, args.max_tokens, args.device, str(adapter))
                base = run(path, 1, "float32", prompts, args.max_tokens, args.device)
                doc["results"]["float32+lora"] = compare(one, two) | {
                    "adapter_prompts": list(range(1, len(prompts), 2)),
                    "adapter_changes_output": [one["tokens"][i] != base["tokens"][i]
                                               for i in range(1, len(prompts), 2)]}
            except Exception as e:
                doc["results"]["float32+lora"] = {"error": f"{type(e).__name__}: {e}"}
            print("float32+lora", json.dumps(doc["results"]["float32+lora"])[:1200], flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
