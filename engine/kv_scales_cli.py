"""`splitserve kv-scales`: calibrate a quantized KV cache's per-layer scales and write them as
JSON for `--kv-scales FILE`.

Every worker started with `--kv-cache-dtype int8` calibrates on its own, on a fixed text, and
workers of one model on one kind of GPU get the same scales. A file pins them: for prefill and
decode workers on different hardware (a decode worker only takes blocks under its own scales),
or to calibrate on text of the deployment's own traffic:

    splitserve kv-scales --kv-cache-dtype int8 --out scales.json [--text traffic.txt] [engine args]

With `--text`, the file is read in chunks of `--chunk-tokens` tokens (one prefill each) and each
layer's scale covers the largest |K| and |V| over all of them.

An int8 file is per channel (`"granularity": "channel"`): besides each layer's K and V scale it
holds a factor per channel within the layer (engine/attention/kv_channels.py); an fp8 file is
per layer, and so is an int8 file calibrated where the GPU decode kernel's QK dot runs on int8
(`kv_channels.qk_dot_on_int8`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.cli_args import add_engine_args, engine_config_from_args

MAX_TEXT_BYTES = 64 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve kv-scales", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--text", default=None,
                   help="calibrate on this UTF-8 text file (default: the engine's fixed text)")
    p.add_argument("--chunk-tokens", type=int, default=2048,
                   help="tokens per calibration prefill with --text")
    add_engine_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kv_cache_dtype not in ("fp8", "int8"):
        print("error: --kv-cache-dtype must be fp8 or int8 (the cache the scales are for)",
              file=sys.stderr)
        return 2
    if args.chunk_tokens < 1:
        print("error: --chunk-tokens must be >= 1", file=sys.stderr)
        return 2
    import torch

    from engine.attention.kv_calibration import kv_scales_document, round_scales
    from engine.attention.kv_channels import channel_factors, layer_amax
    from engine.attention.kv_quant import scales_from_amax
    from engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    # The engine calibrates at start exactly as a worker does; a small cache is enough, and no
    # decode step runs, so no CUDA graphs are captured.
    config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, kv_scales="calibrate", num_gpu_blocks=16,
                                          enable_prefix_caching=False),
        runner=dataclasses.replace(config.runner, enforce_eager=True))
    engine = LLMEngine(config, detokenize=False)
    runner = engine.runner
    tokens = runner.kv_calibration_tokens
    scales, factors = runner.kv_scales, runner.kv_channel_factors
    if args.text is not None:
        if engine.tokenizer is None:
            print("error: --text needs a model with a tokenizer", file=sys.stderr)
            return 2
        path = Path(args.text)
        try:
            if path.stat().st_size > MAX_TEXT_BYTES:
                print(f"error: {path} is larger than {MAX_TEXT_BYTES >> 20} MiB",
                      file=sys.stderr)
                return 2
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 2
        ids = engine.tokenizer.encode(text)
        size = min(args.chunk_tokens, runner.max_model_len)
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
        if not chunks:
            print(f"error: {path} holds no tokens", file=sys.stderr)
            return 2
        amax = torch.stack([runner.measure_kv_amax(c) for c in chunks]).amax(0)
        scales = round_scales(scales_from_amax(layer_amax(amax), runner.kv_dtype))
        # Factors where the engine calibrates them (int8, and not under the GPU's int8 QK dot).
        factors = channel_factors(amax) if runner.kv_channel_factors is not None else None
        tokens = len(ids)
    doc = kv_scales_document(scales, args.kv_cache_dtype, factors)
    doc["calibration"] = {"model": args.model, "tokens": tokens, "text": args.text}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {len(scales)} layers ({doc['granularity']}), K {scales[:, 0].min():.4g}.."
          f"{scales[:, 0].max():.4g}, V {scales[:, 1].min():.4g}..{scales[:, 1].max():.4g}")
    return 0
