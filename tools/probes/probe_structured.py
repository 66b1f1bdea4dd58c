"""What structured outputs cost the engine's decode steps, and that they hold on the device.

For each batch size, one `generate` of that many fresh prompts in each workload (greedy;
every output token is a step of the whole batch):
- `plain`: free text;
- `regex_all`: every request under the regex `[a-z ]+` (a mask every step for every row);
- `regex_one`: one such request among free ones (a constrained request's steps finish before
  the next is scheduled, so under async scheduling the whole batch loses the overlap);
- `penalty_one`: one request with a repetition penalty among free ones (its sampling reads its
  output history too, and settles the previous step the same way);
- `penalty_all`: every request with repetition, frequency and presence penalties;
- `json`: every request under a JSON schema in its fixed layout (`any_whitespace=False`: any
  whitespace would let random weights spend every token on it; with bounded fields, each output
  ends by itself): how many outputs parse and match it.
Reported per workload: output tokens, wall time, output tok/s, median inter-token latency, and
the finish reasons. Then `mask_logits` alone (fill the rows' bitmasks on the host, copy, apply)
at each batch size, device-timed.

Dummy weights come without a tokenizer: `--tokenizer` names one (`python -m
tools.synthetic_tokenizer --vocab-size 128256 --out-dir /tmp/tok` writes a byte-level one of
Llama 3's size). Random weights say nothing sensible, but the constraint must hold all the same.

Usage: PYTHONPATH=. python3 tools/probes/probe_structured.py --out F [--model M --tokenizer T]
           [--batch 1,16,64] [--max-tokens 128] [--prompt-len 128] [--device cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.results import git_info

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 4},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
FREE_REGEX = "[a-z ]+"
WORKLOADS = ("plain", "regex_all", "regex_one", "penalty_one", "penalty_all", "json")


def _matches_schema(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"name", "age", "tags", "ok"}
            and isinstance(v["name"], str) and len(v["name"]) <= 24
            and type(v["age"]) is int and 0 <= v["age"] <= 120
            and isinstance(v["tags"], list) and len(v["tags"]) <= 4
            and all(t in ("a", "b", "c") for t in v["tags"]) and isinstance(v["ok"], bool))


def _run(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    itls: list[float] = []
    for o in outs:
        times = o.metrics.token_times if o.metrics is not None else []
        itls += [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # The texts without the EOS that ended them: a synthetic vocabulary may spell an EOS id as
    # a word (it marks only Llama 3's <|eot_id|> special), which is not the output's text.
    tok, eos = llm.engine.tokenizer, set(llm.engine.eos_token_ids)
    texts = [tok.decode([t for i, t in enumerate(ids) if i < len(ids) - 1 or t not in eos])
             for ids in (o.outputs[0].token_ids for o in outs)]
    reasons: dict[str, int] = {}
    for o in outs:
        reasons[str(o.outputs[0].finish_reason)] = reasons.get(str(o.outputs[0].finish_reason), 0) + 1
    return {"output_tokens": tokens, "wall_s": round(wall, 4),
            "output_tok_s": round(tokens / wall, 1),
            "median_itl_ms": round(statistics.median(itls), 3) if itls else None,
            "finish_reasons": reasons, "texts": texts}


def _mask_cost(llm: Any, batch: int, repeats: int) -> dict[str, float]:
    import torch

    from engine.request import Request
    from engine.sampler import mask_logits
    from engine_api.sampling_params import SamplingParams, StructuredOutputs

    eng = llm.engine
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    reqs = []
    for i in range(batch):
        r = Request(f"m{i}", [1], SamplingParams(structured_outputs=spec))
        r.grammar = eng.grammars.grammar(spec)
        reqs.append(r)
    dev = eng.runner.device
    logits = torch.zeros(batch, eng.model_config.vocab_size, device=dev)
    for _ in range(3):
        mask_logits(logits, reqs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        mask_logits(logits, reqs)
    host = (time.perf_counter() - t0) / repeats * 1e3
    if dev.type == "cuda":
        torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / repeats * 1e3
    # The device's masked rows against the same masks applied on the CPU.
    raw = torch.randn(batch, eng.model_config.vocab_size, generator=torch.Generator().manual_seed(1))
    same = torch.equal(mask_logits(raw.to(dev), reqs).cpu(), mask_logits(raw.clone(), reqs))
    return {"host_ms": round(host, 4), "with_device_ms": round(total, 4),
            "device_equals_cpu": same}


def _penalty_slots(llm: Any) -> int:
    state = llm.engine.runner.sampler._penalties
    return 0 if state is None else int(state.num_slots)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--mask-repeats", type=int, default=50)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"a subset of {','.join(WORKLOADS)}")
    args = p.parse_args()

    from engine import LLM, SamplingParams
    from engine_api.sampling_params import StructuredOutputs

    batches = [int(b) for b in args.batch.split(",")]
    kwargs: dict[str, Any] = {"device": args.device, "dtype": args.dtype,
                              "max_num_seqs": max(batches), "max_model_len": 2048}
    if args.model:
        kwargs["model"] = args.model
    if args.tokenizer:
        kwargs["tokenizer"] = args.tokenizer
    llm = LLM(**kwargs)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    t0 = time.perf_counter()
    llm.engine.grammars.compile(StructuredOutputs(regex=FREE_REGEX))  # imports xgrammar
    first_compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.engine.grammars.compile(StructuredOutputs(json=json.dumps(SCHEMA), any_whitespace=False))
    schema_compile_s = time.perf_counter() - t0

    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    regex = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                           structured_outputs=StructuredOutputs(regex=FREE_REGEX))
    penalized = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                               repetition_penalty=1.1)
    all_penalties = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                   repetition_penalty=1.1, frequency_penalty=0.2,
                                   presence_penalty=0.1)
    wanted = args.workloads.split(",")
    unknown = set(wanted) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    schema = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA),
                                                                any_whitespace=False))
    # Warm-up: graphs, kernels, the grammar's first masks.
    _run(llm, [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(2)],
         [free, regex])
    results: dict[str, Any] = {}
    for b in batches:
        row: dict[str, Any] = {}
        for name, params in (("plain", [free] * b), ("regex_all", [regex] * b),
                             ("regex_one", [regex] + [free] * (b - 1)),
                             ("penalty_one", [penalized] + [free] * (b - 1)),
                             ("penalty_all", [all_penalties] * b),
                             ("json", [schema] * b)):
            if (name.endswith("_one") and b == 1) or name not in wanted:
                continue
            prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(b)]
            res = _run(llm, prompts, params)
            texts = res.pop("texts")
            if name == "json":
                res["valid_json"] = sum(_matches_schema(t) for t in texts)
                res["example"] = texts[0][:200]
                # What an invalid one looked like (a run at 41e58b0 had 255 of 256 without it).
                res["invalid"] = [t[:300] for t in texts if not _matches_schema(t)][:5]
            if name == "regex_all":
                res["all_match"] = all(t and set(t) <= set("abcdefghijklmnopqrstuvwxyz ")
                                       for t in texts)
            row[name] = res
        row["mask_logits_json"] = _mask_cost(llm, b, args.mask_repeats)
        results[str(b)] = row
        print(json.dumps({str(b): row}), flush=True)

    out = {"probe": "structured", **git_info(), "model": args.model or "SmolLM2-135M-Instruct",
           "device": str(llm.engine.runner.device), "vocab_size": vocab,
           "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
           "async_scheduling": llm.engine.async_scheduling,
           "first_compile_s": round(first_compile_s, 3),
           "schema_compile_s": round(schema_compile_s, 4),
           # The KV cache's size, and the penalty history's slots after the runs (at most
           # max_num_seqs, kept out of the cache's budget: engine/penalties.py).
           "num_gpu_blocks": llm.engine.runner.result.num_blocks,
           "max_num_seqs": max(batches),
           "penalty_slots": _penalty_slots(llm), "batches": results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
