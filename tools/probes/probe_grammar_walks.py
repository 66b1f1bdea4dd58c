"""Random walks through a JSON schema's grammar: does every complete walk parse and match?

No model: each step draws random logits, masks them with the request's grammar exactly as the
sampler does (`engine.structured.mask_logits`), takes the argmax and advances the grammar,
until the grammar accepts a stop token. Every walk's text (without that stop token) must pass
`tools/probes/probe_structured.py`'s schema check. Finds holes in the constraint itself (xgrammar's
or ours) independently of what a model prefers.

Usage: PYTHONPATH=. python3 tools/probes/probe_grammar_walks.py --out F [--tokenizer T] [--vocab-size V]
           [--walks 300] [--scale 3] [--seed 1] [--boost-high-bytes 6]
(default tokenizer: `python -m tools.synthetic_tokenizer --vocab-size 128256 --out-dir /tmp/tok`)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.results import git_info
from tools.probes.probe_structured import SCHEMA, _matches_schema


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="/tmp/tok/tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--stop-ids", default="128001,128008,128009")
    p.add_argument("--walks", type=int, default=300)
    p.add_argument("--scale", type=float, default=3.0, help="logits ~ N(0, scale^2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--boost-high-bytes", type=float, default=0.0,
                   help="added to the logits of the single-byte tokens 0x80-0xFF (byte-level "
                        "vocabularies): walks that spell multi-byte characters byte by byte")
    args = p.parse_args()

    import torch

    from engine.request import Request
    from engine.sampler import mask_logits
    from engine.structured import GrammarCompiler
    from engine_api.sampling_params import SamplingParams, StructuredOutputs
    from engine_api.tokenizer import Tokenizer, _bytes_to_unicode

    tok = Tokenizer.from_file(args.tokenizer)
    spell = _bytes_to_unicode()
    high = [i for b in range(0x80, 0x100) if (i := tok.backend.token_to_id(spell[b])) is not None]
    stops = [int(t) for t in args.stop_ids.split(",")]
    compiler = GrammarCompiler(tok, args.vocab_size, stops)
    spec = StructuredOutputs(json=json.dumps(SCHEMA), any_whitespace=False)
    gen = torch.Generator().manual_seed(args.seed)
    invalid: list[str] = []
    unfinished = 0
    for walk in range(args.walks):
        req = Request(f"w{walk}", [1], SamplingParams(structured_outputs=spec))
        req.grammar = grammar = compiler.grammar(spec)
        ids: list[int] = []
        while not grammar.is_terminated and len(ids) < 400:
            logits = torch.randn(1, args.vocab_size, generator=gen) * args.scale
            if args.boost_high_bytes:
                logits[0, high] += args.boost_high_bytes
            token = int(mask_logits(logits, [req]).argmax())
            if not grammar.accept(token):
                break
            ids.append(token)
        if not grammar.is_terminated:
            unfinished += 1
            continue
        text = tok.decode([t for t in ids if t not in stops])
        if not _matches_schema(text):
            invalid.append(text[:300])
    out = {"probe": "grammar_walks", **git_info(), "tokenizer": args.tokenizer,
           "walks": args.walks, "scale": args.scale, "seed": args.seed,
           "boost_high_bytes": args.boost_high_bytes,
           "unfinished": unfinished, "invalid": len(invalid), "invalid_texts": invalid[:10]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "invalid_texts"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
