"""How far a quantized configuration (KV cache, weights, the fast path) moves the model's outputs.

A reference engine continues each prompt greedily; then every engine (the reference and each
variant) runs one prefill of prompt + continuation (`ModelRunner.prefill_logits`: every
position reads its own and earlier K/V back from its cache, as decoding does), and each
variant's logits at the continuation positions are compared with the reference's: top-1
agreement, relative L2 error of the logits, KL(reference || variant). `--pair A/B` compares
two variants with each other the same way (B as the reference): e.g. W8A8 on the Triton fast
path against W8A8 on the torch backend, beside how far each is from bf16 (the noise floor the
quantization itself sets, which a comparison of the two paths alone cannot show).

A variant is `NAME:option=value,...` with options kv_cache_dtype (auto|fp8|int8), kv_scales
(calibrate or a scales file), quantization (none|fp8|int8) and attention_backend
(auto|torch|triton); `--reference` takes the same options. A model without a tokenizer (dummy weights) gets random prompts of fixed
lengths from a fixed seed.

Usage: PYTHONPATH=. python3 tools/probes/probe_accuracy.py --out F [--model M] [--device cpu]
       [--variant fp8:kv_cache_dtype=fp8 ...] [--pair A/B] [--max-tokens 48]
(the default variants are the fp8 and int8 KV caches against the model-dtype cache).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
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
RANDOM_PROMPT_LENS = (5, 17, 64, 100, 256, 333, 512, 40)
# An option's allowed values (None: any, e.g. kv_scales=calibrate or a scales file).
OPTIONS: dict[str, tuple[str, ...] | None] = {
    "kv_cache_dtype": ("auto", "fp8", "int8"), "kv_scales": None,
    "quantization": ("none", "fp8", "int8"), "attention_backend": ("auto", "torch", "triton")}
DEFAULT_VARIANTS = ("fp8:kv_cache_dtype=fp8", "int8:kv_cache_dtype=int8")


def parse_options(text: str) -> dict[str, str]:
    """`opt=value,...` → a dict of the engine options `OPTIONS` allows (ValueError otherwise)."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        allowed = OPTIONS.get(key, ())
        if not sep or key not in OPTIONS or not value or (allowed and value not in allowed):
            raise ValueError(f"bad option {item!r}: expected one of " + "; ".join(
                f"{k}={'|'.join(v) if v else 'VALUE'}" for k, v in OPTIONS.items()))
        out[key] = value
    return out


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, sep, opts = text.partition(":")
    if not sep or not name:
        raise ValueError(f"a variant is NAME:option=value,... (got {text!r})")
    return name, parse_options(opts)


def compare(got: list[torch.Tensor], ref: list[torch.Tensor],
            targets: list[list[int]]) -> dict[str, float]:
    """Top-1 agreement with `targets`, relative L2 error and KL(ref || got) over all positions."""
    agree = total = 0
    rel: list[float] = []
    kl: list[float] = []
    for g, r, t in zip(got, ref, targets, strict=True):
        agree += int((g.argmax(-1) == torch.tensor(t)).sum())
        total += len(t)
        rel += ((g - r).norm(dim=-1) / r.norm(dim=-1)).tolist()
        kl += torch.nn.functional.kl_div(g.log_softmax(-1), r.log_softmax(-1),
                                         log_target=True, reduction="none").sum(-1).tolist()
    return {"top1_agreement": agree / total,
            "rel_l2_logits_mean": sum(rel) / len(rel), "rel_l2_logits_max": max(rel),
            "kl_mean": sum(kl) / len(kl), "kl_max": max(kl)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--reference", default="", help="the reference engine's options")
    p.add_argument("--variant", action="append", default=None,
                   help=f"NAME:option=value,... (repeatable; default {' '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--pair", action="append", default=[],
                   help="A/B: also compare variant A with variant B (B as the reference)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args(argv)
    try:
        reference_opts = parse_options(args.reference)
        variants = dict(parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS))
        pairs = [tuple(s.split("/")) for s in args.pair]
        for pair in pairs:
            if len(pair) != 2 or not all(n in variants for n in pair):
                raise ValueError(f"--pair takes A/B of variant names, got {'/'.join(pair)!r}")
    except ValueError as e:
        p.error(str(e))
    from engine.llm import LLM
    from engine_api.sampling_params import SamplingParams

    def engine(opts: dict[str, str]) -> Any:
        return LLM(model=args.model, device=args.device, dtype=args.dtype, num_gpu_blocks=256,
                   enable_prefix_caching=False, max_model_len=args.max_model_len,
                   **opts)  # type: ignore[arg-type]

    def release(llm: Any) -> None:
        llm.shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    start = time.perf_counter()
    ref = engine(reference_opts)
    tok = ref.get_tokenizer()
    if tok is not None:
        prompts = [tok.encode(t) for t in PROMPTS]
    else:
        rng = random.Random(0)
        vocab = ref.engine.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in RANDOM_PROMPT_LENS]
    outs = ref.generate([{"prompt_token_ids": q} for q in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                       ignore_eos=True))
    sequences = [(q, o.outputs[0].token_ids) for q, o in zip(prompts, outs, strict=True)]
    if any(len(c) < args.max_tokens for _, c in sequences):
        raise SystemExit(f"a continuation stopped short of {args.max_tokens} tokens: raise "
                         f"--max-model-len (prompts of up to {max(map(len, prompts))} tokens)")
    targets = [c for _, c in sequences]

    def logits_of(llm: Any) -> list[torch.Tensor]:
        # Positions len(prompt) - 1 .. end - 1 predict the continuation's tokens.
        return [llm.engine.runner.prefill_logits(q + c[:-1])[len(q) - 1:] for q, c in sequences]

    reference = logits_of(ref)
    total = sum(len(c) for c in targets)
    # The reference's own prefill must predict its greedy continuation (a check on the probe).
    self_agree = compare(reference, reference, targets)["top1_agreement"]
    doc: dict[str, Any] = {**git_info(), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
                           "device": args.device, "dtype": str(ref.engine.runner.dtype),
                           "reference": reference_opts, "prompts": len(prompts),
                           "positions": total, "reference_self_agreement": self_agree,
                           "variants": {}, "pairs": {}}
    if torch.cuda.is_available() and args.device != "cpu":
        doc["gpu"] = torch.cuda.get_device_name()
    release(ref)
    del ref
    kept: dict[str, list[torch.Tensor]] = {}
    for name, opts in variants.items():
        llm = engine(opts)
        got = logits_of(llm)
        row: dict[str, Any] = {"options": opts, **compare(got, reference, targets)}
        scales = llm.engine.runner.kv_scales
        if scales is not None and opts.get("kv_cache_dtype", "auto") != "auto":
            row["k_scale_range"] = [float(scales[:, 0].min()), float(scales[:, 0].max())]
            row["v_scale_range"] = [float(scales[:, 1].min()), float(scales[:, 1].max())]
        doc["variants"][name] = row
        print(name, row, flush=True)
        if any(name in pair for pair in pairs):
            kept[name] = got
        release(llm)
        del llm
    for a, b in pairs:
        b_targets = [r.argmax(-1).tolist() for r in kept[b]]
        doc["pairs"][f"{a}/{b}"] = compare(kept[a], kept[b], b_targets)
        print(f"{a}/{b}", doc["pairs"][f"{a}/{b}"], flush=True)
    doc["wall_s"] = round(time.perf_counter() - start, 1)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
