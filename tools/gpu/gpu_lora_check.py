"""LoRA adapters on the GPU path: correctness against the torch reference, and what they cost.

1. A random Llama checkpoint (hidden 1,024, 16 heads over 8 KV heads, 4 layers) with two random
   PEFT adapters (rank 16 on q/k/v/o; rank 8 on every projection, rsLoRA). The fast engine
   (Triton attention, CUDA graphs with the adapters' deltas inside) generates greedily for a
   batch that mixes the base model and both adapters; the reference engine (torch attention,
   float32, eager) then scores each prompt + continuation under the same adapter in one
   prefill. A token is accepted when the reference ranks it at (or within `--tol` logits of)
   the top, as tools/gpu/gpu_engine_check.py does; float32 fast paths must agree exactly.
2. Decode step time on dummy Llama-3.1-8B weights (bf16): without adapters, with a rank-16
   adapter on every projection loaded but unused, and with every request running it; batch 1
   and 16, the median inter-token latency of 64 tokens.

With `--max-loras N` (runtime loading, engine/lora/stack.py's slotted layout): the fast
engine of 1. starts with N empty slots, captures its graphs, and only then gets its adapters
(`LLMEngine.add_lora`), after a decoy adapter was loaded into the first slot, used, and
unloaded — so stale columns or graphs that miss in-place writes would show; 2. adds the same
adapter in one of N slots (every projection pays for every slot).

Usage: PYTHONPATH=. python3 tools/gpu/gpu_lora_check.py --out $OUT/lora_check.json [--max-loras 4]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import LoadConfig, ModelConfig
from engine.loader import load_model_source
from engine.lora.adapter import ATTENTION_TARGETS, MLP_TARGETS, target_shape
from tools.gpu.gpu_tp_check import write_checkpoint


def write_adapter(path: Path, cfg: ModelConfig, targets: tuple[str, ...], rank: int,
                  alpha: float, seed: int, std: float = 0.2, **extra: object
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT adapter directory with random A and B (seeded) for `targets` of every layer;
    returns its weights, (layer, target) -> (A [r, in], B [out, r]). Also the tests' adapters."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    weights = {}
    for layer in range(cfg.num_hidden_layers):
        for t in targets:
            n_in, n_out = target_shape(cfg, t)
            block = "mlp" if t in MLP_TARGETS else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{t}"
            a = torch.randn(rank, n_in, generator=gen) * std
            b = torch.randn(n_out, rank, generator=gen) * std
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            weights[(layer, t)] = (a, b)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
         "target_modules": list(targets), "task_type": "CAUSAL_LM", **extra}))
    return weights


def reference_logits(llm: LLM, ids: list[int], lora: str | None) -> torch.Tensor:
    eng = llm.engine
    eng.add_request("ref", ids, SamplingParams(max_tokens=1, temperature=0), lora_name=lora)
    out = eng.scheduler.schedule()
    assert len(out.scheduled) == 1 and out.scheduled[0].num_new_tokens == len(ids), out
    logits = eng.runner.logits_for(out).float().cpu()
    eng.abort_request("ref")
    return logits


def correctness(ckpt: Path, adapters: dict[str, str], dtype: str, tol: float,
                max_loras: int = 0, decoy: str = "") -> dict[str, Any]:
    rng = random.Random(1)
    prompts = [[rng.randrange(32000) for _ in range(rng.randrange(20, 300))] for _ in range(6)]
    names: list[str | None] = [None, "attn", "every", None, "every", "attn"]
    fast = LLM(str(ckpt), dtype=dtype, lora_modules=None if max_loras else adapters,
               max_loras=max_loras, max_lora_rank=16, max_model_len=2048,
               num_gpu_blocks=2048, max_num_seqs=16, cuda_graph_max_batch=16)
    runner = fast.engine.runner
    sets = {"base": runner.graphs, "lora": runner.lora_graphs}
    before = {k: g.num_replays for k, g in sets.items() if g is not None}
    eng = fast.engine
    if max_loras:  # after the graphs: a decoy in slot 1, used and gone, then the adapters
        eng.add_lora("decoy", decoy)
        fast.generate([{"prompt_token_ids": prompts[0][:50]}],
                      SamplingParams(temperature=0, max_tokens=8), lora_request="decoy")
        eng.remove_lora("decoy")
        for adapter, path in adapters.items():
            eng.add_lora(adapter, path)
    for i, (p, name) in enumerate(zip(prompts, names, strict=True)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=32,
                                                   ignore_eos=True), lora_name=name)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    doc: dict[str, Any] = {
        "max_loras": max_loras, "slots": {n: runner.lora.slot(n) for n in adapters
                                          } if runner.lora is not None else {},
        "graph_replays": {k: g.num_replays - before[k] for k, g in sets.items() if g is not None},
        "lora_steps": fast.engine.runner.num_lora_steps,
        "cuda_graphs": fast.engine.runner.result.cuda_graphs}
    fast.shutdown()
    del fast
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ref = LLM(str(ckpt), dtype="float32", attention_backend="torch", enforce_eager=True,
              lora_modules=adapters, max_model_len=2048, num_gpu_blocks=2048)
    rows = []
    for i, (p, name) in enumerate(zip(prompts, names, strict=True)):
        out = tokens[f"r{i}"]
        logits = reference_logits(ref, p + out[:-1], name)[len(p) - 1:]
        top = logits.max(-1).values
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        gap = (top - chosen)
        row = {"lora": name, "prompt_len": len(p), "tokens": len(out),
               "exact_argmax": int((gap == 0).sum()), "max_gap": float(gap.max()),
               "within_tol": bool((gap <= tol).all())}
        if name is not None:  # the adapter matters: the base model would often pick otherwise
            base = reference_logits(ref, p + out[:-1], None)[len(p) - 1:].argmax(-1)
            row["base_model_argmax_agreement"] = float(
                (base == torch.tensor(out)).float().mean())
        rows.append(row)
    ref.shutdown()
    doc["requests"] = rows
    doc["ok"] = all(r["within_tol"] for r in rows)
    return doc


def step_ms(llm: LLM, batch: int, lora: str | None) -> float:
    """Median inter-token latency of `batch` requests decoding 64 tokens together (each token's
    arrival time on the host, `RequestMetrics.token_times`), after one warm-up run."""
    prompts = [{"prompt_token_ids": [7 + i] * 512} for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
    llm.generate(prompts, sp, lora_request=lora)  # warm-up; the prompts are cached after it
    gaps: list[float] = []
    for out in llm.generate(prompts, sp, lora_request=lora):
        assert out.metrics is not None
        t = out.metrics.token_times
        gaps.extend(b - a for a, b in itertools.pairwise(t[1:]))  # after the first token
    return round(float(torch.tensor(gaps).median()) * 1000, 3)


def cost(adapter: str, max_loras: int = 0) -> dict[str, Any]:
    results: dict[str, Any] = {}
    configs: list[tuple[str, dict[str, str] | None, int]] = [
        ("no_lora", None, 0), ("lora_loaded", {"r16": adapter}, 0)]
    if max_loras:
        configs.append((f"slots{max_loras}", {"r16": adapter}, max_loras))
    for label, modules, slots in configs:
        llm = LLM("dummy:llama-3.1-8b", dtype="bfloat16", lora_modules=modules,
                  max_loras=slots, max_lora_rank=16,
                  max_model_len=4096, num_gpu_blocks=8192, max_num_seqs=32,
                  cuda_graph_max_batch=32)
        for batch in (1, 16):
            results[f"{label}_base_bs{batch}_ms"] = step_ms(llm, batch, None)
            if modules:
                results[f"{label}_adapter_bs{batch}_ms"] = step_ms(llm, batch, "r16")
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--max-loras", type=int, default=0,
                   help="also check runtime loading into this many slots (and its cost)")
    args = p.parse_args()
    doc: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
                           "commit": os.environ.get("SPLITSERVE_COMMIT", ""),
                           "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_checkpoint(ckpt, seed=0, std=0.02)
        cfg = load_model_source(LoadConfig(model=str(ckpt))).config
        write_adapter(Path(tmp) / "attn", cfg, ATTENTION_TARGETS, 16, 16, 1, 0.03)
        write_adapter(Path(tmp) / "every", cfg, ATTENTION_TARGETS + MLP_TARGETS, 8, 16, 2,
                      0.03, use_rslora=True)
        adapters = {"attn": str(Path(tmp) / "attn"), "every": str(Path(tmp) / "every")}
        write_adapter(Path(tmp) / "decoy", cfg, ATTENTION_TARGETS + MLP_TARGETS, 16, 64, 5,
                      0.05)
        runs = [("", 0)] + ([("_runtime", args.max_loras)] if args.max_loras else [])
        for dtype in () if args.skip_correctness else ("float32", "bfloat16"):
            for suffix, slots in runs:
                key = f"correctness_{dtype}{suffix}"
                try:
                    doc[key] = correctness(ckpt, adapters, dtype, args.tol, slots,
                                           str(Path(tmp) / "decoy"))
                except Exception as e:  # recorded; the rest still runs
                    doc[key] = {"error": f"{type(e).__name__}: {e}"}
                print(key, json.dumps(doc[key])[:1500], flush=True)
        if not args.skip_cost:
            big = load_model_source(LoadConfig(model="dummy:llama-3.1-8b")).config
            write_adapter(Path(tmp) / "r16", big, ATTENTION_TARGETS + MLP_TARGETS, 16, 32, 3,
                          0.01)
            try:
                doc["decode_step_ms"] = cost(str(Path(tmp) / "r16"), args.max_loras)
            except Exception as e:
                doc["decode_step_ms"] = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(doc["decode_step_ms"]), flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
