"""Sequence classification and beam search on the GPU path.

1. Classifier: a random `Qwen3ForSequenceClassification` (hidden 1,024, 16 heads over 8 KV
   heads, head_dim 64, 4 layers, 3 labels) written by `transformers`; the engine (Triton
   attention, CUDA graphs) classifies 8 prompts of 17-1,500 tokens, in float32 and bf16, against
   `transformers`' own model on the same weights in float32 on the GPU (max |logit difference|).
2. Beam search: 4 prompts, width 4, 64 tokens, EOS ignored, timed against greedy generation
   of the same prompts; width 1 against greedy's tokens (and, where they part, greedy's top-2
   logprob gap there: a bf16 near-tie or not). On a random 4-layer Llama in float32 (prefill
   and decode kernels differ by rounding only, ~1e-6, so width 1 should be greedy), then
   on dummy Llama-3.1-8B in bf16 (512-token prompts).

Usage: PYTHONPATH=. python3 tools/gpu/gpu_classify_beam_check.py --out $OUT/classify_beam.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

from bench.results import git_info
from engine import LLM, SamplingParams
from engine_api.beam_search import BeamSearchParams
from tools.gpu.gpu_tp_check import write_checkpoint

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def write_classifier(path: Path, seed: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
                      id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    model = Qwen3ForSequenceClassification(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    cast(Any, model).save_pretrained(path, safe_serialization=True)
    return model


def check_classifier(prompts: list[list[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref = write_classifier(Path(tmp), seed=3).float().cuda().eval()
        with torch.no_grad():
            want = [ref(torch.tensor([p], device="cuda")).logits[0].float().cpu()
                    for p in prompts]
        del ref
        _free()
        for dtype in ("float32", "bfloat16"):
            llm = LLM(tmp, dtype=dtype, gpu_memory_utilization=0.3, max_model_len=2048)
            t0 = time.perf_counter()
            got = llm.classify([{"prompt_token_ids": p} for p in prompts])
            seconds = time.perf_counter() - t0
            diffs = [float((torch.tensor(g.outputs.logits) - w).abs().max())
                     for g, w in zip(got, want, strict=True)]
            argmax_same = sum(int(torch.tensor(g.outputs.logits).argmax() == w.argmax())
                              for g, w in zip(got, want, strict=True))
            out[dtype] = {"max_abs_logit_diff": max(diffs), "per_prompt": diffs,
                          "argmax_agrees": argmax_same, "prompts": len(prompts),
                          "seconds": seconds, "labels": list(llm.engine.class_labels)}
            print(dtype, out[dtype], flush=True)
            del llm
            _free()
    return out


def check_beam(prompts: list[list[int]], width: int, max_tokens: int,
               model: str = "dummy:llama-3.1-8b", dtype: str = "bfloat16") -> dict[str, Any]:
    llm = LLM(model, dtype=dtype, gpu_memory_utilization=0.85, max_model_len=4096)
    asked = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(asked[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    t0 = time.perf_counter()
    greedy = llm.generate(asked, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True, logprobs=2))
    greedy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    beams = llm.beam_search(asked, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                    ignore_eos=True))
    beam_s = time.perf_counter() - t0
    one = llm.beam_search(asked, BeamSearchParams(beam_width=1, max_tokens=max_tokens,
                                                  ignore_eos=True))
    same = [o.sequences[0].output_token_ids == g.outputs[0].token_ids
            for o, g in zip(one, greedy, strict=True)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(o.sequences[0].output_token_ids,
                                                          g.outputs[0].token_ids, strict=True))
                        if a != b), None) for o, g in zip(one, greedy, strict=True)]
    # How close a call each first difference was: greedy's top-2 logprob gap there.
    margins = []
    for g, i in zip(greedy, first_diff, strict=True):
        lps = g.outputs[0].logprobs
        top = sorted((lp for _, lp in lps[i].top), reverse=True) if lps and i is not None else []
        margins.append(top[0] - top[1] if len(top) > 1 else None)
    result = {"prompts": len(prompts), "prompt_len": len(prompts[0]), "width": width,
              "max_tokens": max_tokens, "greedy_s": greedy_s, "beam_s": beam_s,
              "beam_steps_per_s": max_tokens / beam_s,
              "beam_tokens_per_s": width * max_tokens * len(prompts) / beam_s,
              "distinct_sequences": [len({tuple(s.output_token_ids) for s in b.sequences})
                                     for b in beams],
              "best_cum_logprob": [b.sequences[0].cum_logprob for b in beams],
              "width1_equals_greedy": same, "width1_first_difference": first_diff,
              "greedy_top2_gap_there": margins}
    print(result, flush=True)
    del llm
    _free()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    rng = random.Random(0)
    lengths = [17, 64, 200, 511, 512, 777, 1024, 1500]
    cls_prompts = [[rng.randrange(32000) for _ in range(n)] for n in lengths]
    beam_prompts = [[rng.randrange(128000) for _ in range(512)] for _ in range(4)]
    result: dict[str, Any] = {**git_info(), "gpu": torch.cuda.get_device_name(),
                              "classifier": check_classifier(cls_prompts)}
    with tempfile.TemporaryDirectory() as tmp:  # float32: width 1 should be greedy
        write_checkpoint(Path(tmp), seed=5)
        small = [[rng.randrange(32000) for _ in range(300)] for _ in range(4)]
        result["beam_search_float32_small"] = check_beam(small, args.width, args.max_tokens,
                                                         tmp, "float32")
    result["beam_search"] = check_beam(beam_prompts, args.width, args.max_tokens)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
