"""Quantized accuracy on real text: each configuration's perplexity, its teacher-forced top-1
agreement with the unquantized model, and how far its decode steps part from a prefill over the
same tokens.

The texts are cut into windows of `--window` tokens; each window is one prefill
(`ModelRunner.prefill_logits`: every position reads its own and earlier K/V back from a cache of
the configuration's dtype, as decoding does), scoring every next token of the window. Per
configuration: perplexity (exp of the mean negative log-likelihood of the text's tokens), its
change against the reference's, top-1 agreement with the reference's argmax at every position,
mean KL(reference || configuration). `decode_vs_prefill`: the first window's first
`--prompt-tokens` tokens continue greedily for `--decode-tokens` steps, one row per step, and a
prefill over prompt + continuation scores the same positions: the largest logit gap between the
two (the W8A8 engine check's symptom, issue 43), beside the reference's own.
`ulp_sensitivity`: the same prefill once more with the embeddings scaled by (1 + 2^-22), a
change in the last bits of every input: how far that alone moves the logits.

A configuration is `NAME:option=value,...` (tools/probes/probe_accuracy.py's options). A text
file is plain text, or `.jsonl` with a "text" field per line.

Usage: PYTHONPATH=. python3 tools/probes/probe_quant_ppl.py --out F [--text FILE ...]
       [--variant w8a8:quantization=fp8 ...] [--window 256]
(the default configurations: W8A8, INT8 weight-only, fp8 KV, int8 KV and their combinations).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.results import git_info
from tools.probes.probe_accuracy import parse_options, parse_variant

DEFAULT_TEXTS = ("bench/data/public_domain_sample.txt", "tools/lm_eval/paragraphs.jsonl")
DEFAULT_VARIANTS = (
    "w8a8:quantization=fp8", "int8_weights:quantization=int8",
    "fp8_kv:kv_cache_dtype=fp8", "int8_kv:kv_cache_dtype=int8",
    "w8a8_fp8_kv:quantization=fp8,kv_cache_dtype=fp8",
    "w8a8_int8_kv:quantization=fp8,kv_cache_dtype=int8",
    "int8_weights_fp8_kv:quantization=int8,kv_cache_dtype=fp8",
    "int8_weights_int8_kv:quantization=int8,kv_cache_dtype=int8",
)


def read_text(path: str) -> str:
    """A plain text file, or the "text" fields of a `.jsonl` file joined by blank lines."""
    raw = Path(path).read_text(encoding="utf-8")
    if path.endswith(".jsonl"):
        return "\n\n".join(json.loads(line)["text"] for line in raw.splitlines() if line.strip())
    return raw


def windows(ids: list[int], size: int) -> list[list[int]]:
    """`ids` in consecutive windows of `size` tokens (the last may be shorter; none under 2)."""
    return [w for i in range(0, len(ids), size) if len(w := ids[i:i + size]) >= 2]


def score(logits: list[torch.Tensor], texts: list[list[int]], ref: list[torch.Tensor] | None
          ) -> dict[str, float]:
    """Perplexity of `texts` under `logits` (row i predicts token i + 1 of its window); with
    `ref`, top-1 agreement with its argmax and mean KL(ref || logits) over the same rows."""
    nll = agree = rows = 0.0
    kl = 0.0
    for i, (got, ids) in enumerate(zip(logits, texts, strict=True)):
        logp = got[:-1].log_softmax(-1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        rows += len(ids) - 1
        if ref is not None:
            want = ref[i][:-1]
            agree += int((got[:-1].argmax(-1) == want.argmax(-1)).sum())
            kl += float(torch.nn.functional.kl_div(logp, want.log_softmax(-1), log_target=True,
                                                   reduction="sum"))
    out = {"perplexity": math.exp(nll / rows), "tokens_scored": int(rows)}
    if ref is not None:
        out.update(top1_agreement=agree / rows, kl_mean=kl / rows)
    return out


def stepped_logits(llm: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of `prompt`, one decode step at a time: (prompt + continuation,
    the logits row `[steps, V]` each step computed for its next token)."""
    from engine.scheduler import SampledToken
    from engine_api.sampling_params import SamplingParams

    eng = llm.engine
    eng.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=steps,
                                                    ignore_eos=True))
    rows: list[torch.Tensor] = []
    tokens = list(prompt)
    while eng.scheduler.has_work():
        out = eng.scheduler.schedule()
        logits = eng.runner.logits_for(out)
        sched = out.scheduled[0]
        sampled = {}
        if sched.sample:
            token = int(logits[-1].argmax())
            rows.append(logits[-1].float().cpu())
            tokens.append(token)
            sampled = {sched.request.request_id: SampledToken(token)}
        eng.scheduler.update_from_output(out, sampled)
    return tokens, torch.stack(rows)


def decode_vs_prefill(llm: Any, prompt: list[int], steps: int) -> float:
    """Largest logit gap between the decode steps and one prefill over the same tokens."""
    tokens, stepped = stepped_logits(llm, prompt, steps)
    whole = llm.engine.runner.prefill_logits(tokens[:-1])[len(prompt) - 1:]
    return float((stepped - whole).abs().max())


def write_doc(path: str, doc: dict[str, Any], start: float) -> None:
    """`doc` with its wall time so far, as indented JSON at `path`."""
    doc["wall_s"] = round(time.perf_counter() - start, 1)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


@contextmanager
def nudged_embeddings(llm: Any, factor: float) -> Iterator[None]:
    """The model's input embeddings scaled by `factor` while inside."""
    embed = llm.engine.runner.model.embed_tokens
    handle = embed.register_forward_hook(lambda _m, _i, out: out * factor)
    try:
        yield
    finally:
        handle.remove()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--text", action="append", default=None,
                   help=f"a text to score (repeatable; default {' '.join(DEFAULT_TEXTS)})")
    p.add_argument("--variant", action="append", default=None,
                   help="NAME:option=value,... (repeatable; default: the eight quantized "
                        "configurations)")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=24)
    args = p.parse_args(argv)
    try:
        variants = {"unquantized": parse_options("")}
        variants.update(parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS))
    except ValueError as e:
        p.error(str(e))
    from engine.llm import LLM

    start = time.perf_counter()
    texts_in = args.text or list(DEFAULT_TEXTS)
    doc: dict[str, Any] = {**git_info(), "model": args.model or "SmolLM2-135M-Instruct (embedded)",
                           "device": "cpu", "dtype": args.dtype, "texts": texts_in,
                           "window": args.window, "variants": {},
                           "note": "CPU, float32; accuracy only (wall_s was taken on a shared "
                                   "2-core machine)"}
    ref: list[torch.Tensor] | None = None
    texts: list[list[int]] = []
    for name, opts in variants.items():
        llm = LLM(model=args.model, device="cpu", dtype=args.dtype, num_gpu_blocks=256,
                  enable_prefix_caching=False, max_model_len=max(512, args.window),
                  **opts)  # type: ignore[arg-type]
        if not texts:
            tok = llm.get_tokenizer()
            texts = [w for t in texts_in for w in windows(tok.encode(read_text(t)), args.window)]
            doc["windows"] = len(texts)
        runner = llm.engine.runner
        logits = [runner.prefill_logits(ids) for ids in texts]
        row: dict[str, Any] = {"options": opts, **score(logits, texts, ref)}
        if ref is None:
            ref = logits
        else:
            base = doc["variants"]["unquantized"]["perplexity"]
            row["perplexity_change"] = row["perplexity"] / base - 1.0
        row["decode_vs_prefill_max_gap"] = decode_vs_prefill(
            llm, texts[0][:args.prompt_tokens], args.decode_tokens)
        with nudged_embeddings(llm, 1.0 + 2.0 ** -22):
            nudged = runner.prefill_logits(texts[0])
        row["ulp_sensitivity_max_gap"] = float((nudged - logits[0]).abs().max())
        doc["variants"][name] = row
        print(name, {k: v for k, v in row.items() if k != "options"}, flush=True)
        llm.shutdown()
        del llm, runner
        gc.collect()
        # Written after every configuration: a run cut short keeps what it measured.
        write_doc(args.out, doc, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
