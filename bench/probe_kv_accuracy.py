"""How much a quantized KV cache (fp8, int8) moves the model's outputs (CPU or GPU).

The reference engine (cache in the model dtype) continues each prompt greedily; then each
engine runs one prefill of prompt + continuation over a cache of its own dtype and scales
(`ModelRunner.prefill_logits`: every position reads its own and earlier K/V back from the
cache, as decoding does) and is compared with the reference's logits at every continuation
position: top-1 agreement, relative L2 error of the logits, KL(reference || quantized).

Usage: PYTHONPATH=. python3 bench/probe_kv_accuracy.py --out F [--model M] [--device cpu]
       [--kv-cache-dtypes fp8,int8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.results import git_info

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "In machine learning, overfitting means",
    "Translate to German: The train leaves at seven.",
    "List three prime numbers greater than 100:",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
)


def _engine(args: argparse.Namespace, kv_cache_dtype: str) -> Any:
    from engine.llm import LLM

    return LLM(model=args.model, device=args.device, dtype=args.dtype,
               kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=256, enable_prefix_caching=False,
               max_model_len=args.max_model_len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtypes", default="fp8,int8")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args(argv)
    from engine.sampling_params import SamplingParams

    start = time.perf_counter()
    ref = _engine(args, "auto")
    tok = ref.get_tokenizer()
    if tok is None:
        raise SystemExit("the model has no tokenizer")
    prompts = [tok.encode(t) for t in PROMPTS]
    outs = ref.generate([{"prompt_token_ids": q} for q in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                       ignore_eos=True))
    sequences = [(q, o.outputs[0].token_ids) for q, o in zip(prompts, outs, strict=True)]

    def logits_of(llm: Any) -> list[torch.Tensor]:
        # Positions len(prompt) - 1 .. end - 1 predict the continuation's tokens.
        return [llm.engine.runner.prefill_logits(q + c[:-1])[len(q) - 1:] for q, c in sequences]

    reference = logits_of(ref)
    # The reference's own prefill must predict its greedy continuation (a check on the probe).
    self_agree = sum(int((r.argmax(-1) == torch.tensor(c)).sum())
                     for r, (_, c) in zip(reference, sequences, strict=True))
    total = sum(len(c) for _, c in sequences)
    doc: dict[str, Any] = {**git_info(), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
                           "device": args.device, "dtype": str(ref.engine.runner.dtype),
                           "prompts": len(PROMPTS), "positions": total,
                           "reference_self_agreement": self_agree / total, "caches": {}}
    del ref
    for kv in args.kv_cache_dtypes.split(","):
        llm = _engine(args, kv)
        got = logits_of(llm)
        agree = 0
        rel: list[float] = []
        kl: list[float] = []
        for g, r, (_, c) in zip(got, reference, sequences, strict=True):
            agree += int((g.argmax(-1) == torch.tensor(c)).sum())
            rel += ((g - r).norm(dim=-1) / r.norm(dim=-1)).tolist()
            kl += torch.nn.functional.kl_div(g.log_softmax(-1), r.log_softmax(-1),
                                             log_target=True, reduction="none").sum(-1).tolist()
        scales = llm.engine.runner.kv_scales
        doc["caches"][kv] = {
            "top1_agreement": agree / total,
            "rel_l2_logits_mean": sum(rel) / len(rel), "rel_l2_logits_max": max(rel),
            "kl_mean": sum(kl) / len(kl), "kl_max": max(kl),
            "k_scale_range": [float(scales[:, 0].min()), float(scales[:, 0].max())],
            "v_scale_range": [float(scales[:, 1].min()), float(scales[:, 1].max())],
        }
        print(kv, doc["caches"][kv], flush=True)
        del llm
    doc["wall_s"] = round(time.perf_counter() - start, 1)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
