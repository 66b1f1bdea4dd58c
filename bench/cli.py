"""`splitserve bench {online,offline,hf-baseline,faults}`: run a benchmark, print a vLLM-style table,
optionally write a JSON result (`--out`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from typing import Any

from tqdm import tqdm

from bench import faults, models, workloads
from bench.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
    format_summary,
    parse_goodput,
    parse_percentiles,
)
from bench.offline import OfflineBenchError
from bench.online import OnlineBenchError
from bench.results import build_result, write_json
from bench.server_info import ServerInfoError
from bench.vllm_fields import vllm_serve_result
from engine.cli_args import lora_module_arg


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="99",
                   help="comma list of percentiles reported for every latency, e.g. 50,90,99")
    p.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:1000 (milliseconds)")


def _add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: number of prefixes")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: own tokens")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn from [0, vocab); default: from --model's config")


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3.1-8b",
                   help="HF directory, .gguf file or dummy:<preset>")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="share of the device's memory for weights, activations and KV cache")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, as vLLM takes it: e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (the fields of SpeculativeConfig)')


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    online = sub.add_parser("online", help="stream requests to a running gateway")
    online.add_argument("--base-url", default="http://127.0.0.1:8000")
    online.add_argument("--model", default=None, help="model name; default: first of /v1/models")
    online.add_argument("--request-rate", type=_positive_float, default=math.inf)
    online.add_argument("--burstiness", type=_positive_float, default=1.0)
    online.add_argument("--max-concurrency", type=int, default=None)
    online.add_argument("--request-timeout", type=_positive_float, default=600.0)
    online.add_argument("--total-timeout", type=_positive_float, default=3600.0)
    online.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME",
                        help="LoRA adapters the server serves: each request names one at random "
                             "as its model (as vllm bench serve does)")
    online.add_argument("--endpoint", choices=("completions", "chat", "embeddings"),
                        default="completions",
                        help="chat: each prompt's text as a user message to "
                             "/v1/chat/completions (vLLM's --backend openai-chat); embeddings: "
                             "POST each prompt to /v1/embeddings (vLLM's --backend "
                             "openai-embeddings; --output-len unused)")
    online.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    online.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback --base-url")
    _add_workload(online)
    _add_common(online)

    offline = sub.add_parser("offline", help="the engine in-process")
    offline.add_argument("--mode", choices=("throughput", "latency", "embed"),
                         default="throughput",
                         help="embed: LLM.embed of every prompt (embeddings; --output-len unused)")
    offline.add_argument("--batch-size", type=int, default=1, help="latency mode: batch size")
    offline.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=[],
                         metavar="NAME=PATH",
                         help="LoRA adapters to load; each request runs one of them, chosen "
                              "at random")
    _add_engine(offline)
    _add_workload(offline)
    _add_common(offline)

    hf = sub.add_parser("hf-baseline", help="transformers generate on the same shapes")
    hf.add_argument("--model", default="dummy:llama-3.1-8b", help="dummy:<preset>")
    hf.add_argument("--dtype", default="bfloat16")
    hf.add_argument("--device", default="auto")
    hf.add_argument("--batch-size", type=int, default=1)
    hf.add_argument("--input-len", type=int, default=512)
    hf.add_argument("--output-len", type=int, default=128)
    _add_common(hf)

    faults.add_parser(sub)
    return parser


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[workloads.BenchRequest]:
    if args.dataset_name == "shared-prefix":
        return workloads.shared_prefix_requests(
            args.num_prompts, args.num_groups, args.prefix_len, args.suffix_len,
            args.output_len, vocab_size, seed=args.seed)
    return workloads.random_requests(args.num_prompts, args.input_len, args.output_len,
                                     vocab_size, args.random_range_ratio, seed=args.seed)


def _vocab_size(args: argparse.Namespace) -> int:
    if args.vocab_size is not None:
        return int(args.vocab_size)
    if args.model is None:
        raise models.ModelSpecError("--vocab-size is required when --model is not given")
    return models.vocab_size_for(args.model)


def _summarise(args: argparse.Namespace, records: list[RequestRecord],
               duration: float, title: str) -> BenchmarkMetrics:
    metrics = compute_metrics(records, duration, parse_percentiles(args.metric_percentiles),
                              parse_goodput(args.goodput))
    print(format_summary(metrics, title))
    for err in metrics.errors[:3]:
        print(f"failed request: {err}", file=sys.stderr)
    return metrics


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("out", "command")}


def _finish(args: argparse.Namespace, model: str, metrics: dict[str, Any]) -> None:
    if args.out:
        path = write_json(args.out, build_result(args.command, model, _settings(args), metrics))
        print(f"wrote {path}")


def cmd_online(args: argparse.Namespace) -> int:
    from bench.online import OnlineSettings, check_target, run_online, server_vocabulary

    check_target(args.base_url, args.allow_remote)  # refuse before building any workload
    settings = OnlineSettings(args.base_url, args.model, args.request_rate, args.burstiness,
                              args.max_concurrency, args.request_timeout, args.total_timeout,
                              args.allow_remote, args.endpoint, args.api_key)
    if args.vocab_size is not None or _local_model(args.model):
        requests = make_requests(args, _vocab_size(args))
    else:  # the served model's name and tokens, from the server itself
        model, pool = asyncio.run(server_vocabulary(settings))
        settings = dataclasses.replace(settings, model=model)
        requests = [dataclasses.replace(r, prompt_token_ids=[pool[i] for i in r.prompt_token_ids])
                    for r in make_requests(args, len(pool))]
    requests = workloads.assign_adapters(requests, args.lora_modules, seed=args.seed)
    offsets = workloads.arrival_times(len(requests), args.request_rate, args.burstiness,
                                      seed=args.seed)
    with tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr) as bar:
        records, duration, model = asyncio.run(run_online(settings, requests, offsets,
                                                          on_done=lambda _: bar.update()))
    metrics = _summarise(args, records, duration, "Serving Benchmark Result")
    _finish(args, model, vllm_serve_result(metrics, records))
    return 0 if metrics.completed else 1


def _local_model(model: str | None) -> bool:
    """A model whose vocabulary size is known here: a dummy preset or a directory with a
    config.json (otherwise it is a served name, and the server's tokenizer is asked)."""
    return model is not None and (model.startswith(models.DUMMY_PREFIX)
                                  or os.path.isfile(os.path.join(model, "config.json")))


def cmd_offline(args: argparse.Namespace) -> int:
    from bench.offline import EngineSettings, build_llm, run_embed, run_latency, run_throughput

    settings = EngineSettings(args.model, args.dtype, args.max_model_len, args.enforce_eager,
                              args.max_num_seqs, args.max_num_batched_tokens,
                              args.attention_backend,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              speculative_config=args.speculative_config,
                              lora_modules=dict(args.lora_modules) or None)
    llm = build_llm(settings)
    # The engine in hand knows its vocabulary (any model it loads, the embedded default too).
    engine = getattr(llm, "engine", None)
    vocab = (int(engine.model_config.vocab_size) if args.vocab_size is None and engine is not None
             else _vocab_size(args))
    if args.mode in ("latency", "embed"):
        result: Any = (
            run_latency(llm, args.batch_size, args.input_len, args.output_len, vocab,
                        seed=args.seed, lora_names=[name for name, _ in args.lora_modules])
            if args.mode == "latency" else run_embed(llm, make_requests(args, vocab)))
        for key, value in dataclasses.asdict(result).items():
            print(f"{key + ':':<24}{value}")
        _finish(args, args.model, dataclasses.asdict(result))
        return 0
    requests = workloads.assign_adapters(make_requests(args, vocab),
                                         [name for name, _ in args.lora_modules], seed=args.seed)
    records, duration = run_throughput(llm, requests)
    metrics = _summarise(args, records, duration, "Offline Benchmark Result")
    doc = metrics.to_dict()
    if args.speculative_config:
        doc.update(spec_counters(llm))
        for key, value in spec_counters(llm).items():
            print(f"{key + ':':<40}{value}")
    _finish(args, args.model, doc)
    return 0


def spec_counters(llm: Any) -> dict[str, Any]:
    """The engine's speculative decoding counters (names as vLLM's metrics)."""
    drafts, accepted = llm.engine.spec_tokens
    return {"spec_decode_num_draft_tokens": drafts,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / drafts if drafts else None}


def cmd_hf_baseline(args: argparse.Namespace) -> int:
    from bench.hf_baseline import build_model, run_generate

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = build_model(args.model, device, args.dtype)
    result = run_generate(hf, args.batch_size, args.input_len, args.output_len, seed=args.seed)
    for key, value in dataclasses.asdict(result).items():
        print(f"{key + ':':<24}{value}")
    _finish(args, args.model, dataclasses.asdict(result))
    return 0


_COMMANDS = {"online": cmd_online, "offline": cmd_offline, "hf-baseline": cmd_hf_baseline,
             "faults": faults.cmd_faults}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, OfflineBenchError, OnlineBenchError, ServerInfoError) as e:
        # Bad input and known refusals end with one clear line; other crashes keep their trace.
        print(f"splitserve bench {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
