"""The engine against `transformers` at an architecture's real widths, on one device.

The tests compare every position with `transformers` on tiny random models on the CPU
(tests/unit/engine/test_model_vs_hf.py); this probe does it where the fast path runs (Triton
kernels, CUDA graphs, bf16) at a preset's widths: a random `transformers` model of that
architecture with the preset's hidden size, heads, head_dim and vocabulary but `--layers`
layers, saved with `save_pretrained` and loaded by the engine like any checkpoint. Then, for random prompts:

- the engine generates greedily (`LLM.generate`: the scheduler, CUDA graphs, the sampler);
- logits of every position of prompt + continuation: `transformers` in float32 (the reference),
  `transformers` in `--dtype` (the floor that dtype sets), the engine in `--dtype`
  (`ModelRunner.prefill_logits`: every position reads its K/V back from a paged cache);
- each against the float32 reference: top-1 agreement, relative L2 error, KL; and how many of
  the engine's greedy tokens `transformers` in `--dtype` generates too (from the start).

Usage: PYTHONPATH=. python3 tools/probes/probe_model_vs_hf.py --out F --preset qwen3-8b --layers 4
       [--device cuda] [--dtype bfloat16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.results import git_info
from engine.spec.shadow import matched_prefix
from tools.probes.probe_accuracy import compare

PROMPT_LENS = (7, 64, 300, 1000)


def build_hf(preset: str, layers: int, path: Path) -> dict[str, Any]:
    """A random `transformers` model of the preset's widths with `layers` layers, saved at
    `path`; its config dict. Norm weights spread around 1 (HF makes them all ones), so a norm
    that is loaded wrong or not applied shows."""
    import transformers

    from engine.loader.presets import PRESETS

    cfg = dict(PRESETS[preset], num_hidden_layers=layers)
    cfg.pop("torch_dtype", None)
    arch = cfg["architectures"][0]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model = getattr(transformers, arch)(config_cls(**cfg))  # the preset's own class
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    return cfg


def hf_outputs(path: Path, dtype: torch.dtype, device: str, seqs: list[list[int]],
               prompts: list[list[int]] | None = None, n: int = 0
               ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """`transformers` in `dtype`, loaded once: logits of every position of each of `seqs`, and
    (given `prompts`) `n` greedy tokens after each."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    logits, tokens = [], []
    with torch.no_grad():
        for ids in seqs:
            logits.append(model(torch.tensor([ids], device=device)).logits[0].float().cpu())
        for ids in prompts or []:
            x = torch.tensor([ids], device=device)
            seq = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
            tokens.append(seq[0, len(ids):].tolist())
    del model
    gc.collect()
    return logits, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-lens", default=",".join(map(str, PROMPT_LENS)))
    args = p.parse_args()

    from engine import LLM, SamplingParams

    dtype = getattr(torch, args.dtype)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        cfg = build_hf(args.preset, args.layers, path)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist() for n in lens]
        llm = LLM(model=str(path), device=args.device, dtype=args.dtype,
                  max_model_len=max(lens) + args.max_tokens + 16)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
        ours_tokens = [o.outputs[0].token_ids for o in outs]
        seqs = [ids + toks for ids, toks in zip(prompts, ours_tokens, strict=True)]
        runner = llm.engine.runner
        ours = [runner.prefill_logits(s) for s in seqs]
        info = {"backend": runner.backend.name, "cuda_graphs": runner.graphs is not None,
                "kv_dtype": str(runner.kv_dtype)}
        llm.engine.shutdown()
        del llm, runner
        gc.collect()
        ref, _ = hf_outputs(path, torch.float32, args.device, seqs)
        hf_low, hf_tokens = hf_outputs(path, dtype, args.device, seqs, prompts, args.max_tokens)

    # Positions whose next token is known: the last prompt position onwards (the continuation).
    targets = [s[len(ids):] for s, ids in zip(seqs, prompts, strict=True)]

    def cont(logits: list[torch.Tensor]) -> list[torch.Tensor]:
        return [lg[len(ids) - 1:-1] for lg, ids in zip(logits, prompts, strict=True)]

    result = {
        "probe": "model_vs_hf", **git_info(), "preset": args.preset, "layers": args.layers,
        "architecture": cfg["architectures"][0], "device": args.device, "dtype": args.dtype,
        "prompt_lens": lens, "max_tokens": args.max_tokens, "engine": info,
        # Every position (prompt and continuation) against transformers in float32.
        "engine_vs_hf_fp32": compare(ours, ref, [r.argmax(-1).tolist() for r in ref]),
        "hf_dtype_vs_hf_fp32": compare(hf_low, ref, [r.argmax(-1).tolist() for r in ref]),
        # The continuation: does the float32 reference pick the engine's own greedy tokens?
        "continuation_engine_vs_hf_fp32": compare(cont(ours), cont(ref), targets),
        "greedy_common_prefix_with_hf_dtype": [matched_prefix(a, b)
                                               for a, b in zip(ours_tokens, hf_tokens,
                                                               strict=True)],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
