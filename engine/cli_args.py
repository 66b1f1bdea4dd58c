"""Engine flags for process edges (`splitserve generate`, `splitserve serve`): defaults are read
from the config dataclasses, never restated here."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields
from typing import Any, get_args

from engine.config import (
    BLOCK_ALLOCATIONS,
    MAX_PIECEWISE_GRAPH_TOKENS,
    SPEC_METHODS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    kv_cache_dtype_name,
    parse_speculative_config,
)
from engine_api.pooling_params import POOLING_TYPES, PoolerConfig


def _default(cls: type, name: str) -> Any:
    for f in fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(name)


def _classifier_tokens(value: str) -> tuple[str, ...]:
    """`no,yes` → ("no", "yes") (PoolerConfig.validate checks them); "" → ()."""
    return tuple(value.split(",")) if value else ()


def _speculative_json(text: str) -> str:
    """--speculative-config: a JSON object with SpeculativeConfig's fields (checked whole in
    `engine_config_from_args`, over the single flags)."""
    try:
        parse_speculative_config(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def _runner_int(field: str, allowed: str) -> Callable[[str], int]:
    """A flag type for the integer RunnerConfig field `field`: RunnerConfig's own rule, refused
    at the flag (`allowed` words the rule for the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
            changes: dict[str, Any] = {field: value}
            RunnerConfig(**changes).validate()
        except (ValueError, ConfigError):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        return value
    return parse


def _dtype_name(text: str) -> str:
    """vLLM's dtype names (half, float) as the config's."""
    name = {"half": "float16", "float": "float32"}.get(text, text)
    if name not in ("auto", "float32", "float16", "bfloat16"):
        raise argparse.ArgumentTypeError(
            f"must be auto, float32, float16, bfloat16, half or float; got {text!r}")
    return name


def _kv_cache_dtype(text: str) -> str:
    try:
        return kv_cache_dtype_name(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _gc_threshold(text: str) -> tuple[int, int, int] | None:
    if text.strip().lower() == "none":
        return None
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 0:
        raise argparse.ArgumentTypeError(
            f"expected three integers >= 0 as G0,G1,G2, or 'none'; got {text!r}")
    return values  # type: ignore[return-value]


def lora_module_arg(text: str) -> tuple[str, str]:
    """NAME=PATH (vLLM's --lora-modules form)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=_default(LoadConfig, "model"),
                   help="HF directory, .gguf file or dummy:<preset> (default: embedded SmolLM2-135M)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json / .gguf override")
    g.add_argument("--load-format", default=_default(LoadConfig, "load_format"),
                   choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--dtype", default=_default(LoadConfig, "dtype"), type=_dtype_name,
                   metavar="{auto,float32,float16,bfloat16,half,float}",
                   help="weights and activations (half = float16, float = float32, as vLLM)")
    g.add_argument("--seed", type=int, default=_default(LoadConfig, "seed"))
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=_default(CacheConfig, "block_size"))
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_default(CacheConfig, "enable_prefix_caching"),
                   help="reuse the KV blocks of earlier prompts' equal prefixes (default: on)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # the older spelling of --no-enable-prefix-caching
    g.add_argument("--block-allocation", default=_default(CacheConfig, "block_allocation"),
                   choices=BLOCK_ALLOCATIONS,
                   help="which free KV blocks are handed out: lru = least recently freed "
                        "first; runs = prompts kept in runs of consecutive blocks, so a KV "
                        "handoff copies a few runs instead of a block at a time; auto = runs "
                        "for the prefill and decode roles, lru otherwise")
    g.add_argument("--num-gpu-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float,
                   default=_default(CacheConfig, "gpu_memory_utilization"))
    g.add_argument("--cpu-kv-cache-gb", type=float, default=None,
                   help="KV cache of an engine on the CPU, in GiB (default: as large as the "
                        "model's weights, at most a tenth of the available memory, at least one "
                        "sequence at --max-model-len)")
    g.add_argument("--kv-cache-dtype", default=_default(CacheConfig, "kv_cache_dtype"),
                   type=_kv_cache_dtype, metavar="{auto,fp8,fp8_e4m3,int8}",
                   help="KV cache storage: auto = model dtype, fp8 (vLLM's fp8_e4m3) = float8 "
                        "e4m3, int8 = int8; both with per-layer K/V scales, int8 also with "
                        "per-channel factors within them (see --kv-scales)")
    g.add_argument("--kv-scales", default=None, metavar="calibrate|FILE",
                   help="scales of an fp8/int8 KV cache: 'calibrate' (one prefill of a fixed "
                        "text at start-up; int8's default) or a JSON file written by "
                        "`splitserve kv-scales` (fp8's default: 1.0)")
    g.add_argument("--max-num-seqs", type=int, default=_default(SchedulerConfig, "max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=_default(SchedulerConfig, "max_num_batched_tokens"))
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--kv-lease-ms", type=int, default=_default(SchedulerConfig, "kv_lease_ms"))
    g.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="overlap scheduling and input preparation of step n+1 with the device's "
                        "work on step n (auto: on for CUDA; never in the prefill role)")
    g.add_argument("--scheduling-policy", default=_default(SchedulerConfig, "policy"),
                   choices=list(get_args(SchedulingPolicy)),
                   help="fcfs: arrival order; priority: each request's `priority` first (lower "
                        "sooner; less urgent running requests are preempted to admit more "
                        "urgent ones), as vLLM's --scheduling-policy priority")
    g.add_argument("--max-queued-requests", type=int,
                   default=_default(SchedulerConfig, "max_queued_requests"),
                   help="refuse a request (RESOURCE_EXHAUSTED; the gateway tries another worker, "
                        "then answers 429) when max-num-seqs plus this many are in flight "
                        "(default: no bound)")
    g.add_argument("--gc-threshold", type=_gc_threshold, default=_default(SchedulerConfig,
                                                                          "gc_threshold"),
                   help="the garbage collector's thresholds in the engine's process, "
                        "'G0,G1,G2' (default: CPython's young ones, full collections 100x "
                        "rarer) or 'none' to leave the interpreter's")
    g.add_argument("--device", default=_default(RunnerConfig, "device"))
    g.add_argument("--attention-backend", default=_default(RunnerConfig, "attention_backend"),
                   choices=["auto", "torch", "triton"])
    g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    g.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=[],
                   metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) loaded at start; a request runs one "
                        "by naming it as its model")
    g.add_argument("--max-lora-rank", type=_positive_int,
                   default=_default(LoRAConfig, "max_lora_rank"),
                   help="adapters of a higher rank are refused")
    g.add_argument("--max-loras", type=_non_negative_int,
                   default=_default(LoRAConfig, "max_loras"),
                   help="adapter slots on the device: adapters may then be loaded and unloaded "
                        "at runtime (the gateway's /v1/load_lora_adapter), at a cost on every "
                        "step for every slot; 0 (default): exactly --lora-modules, packed")
    g.add_argument("--enable-lora", action="store_true",
                   help="vLLM's flag: without --max-loras, one slot per --lora-modules adapter "
                        "(at least one), so adapters can be swapped at runtime")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int,
                   default=_default(ParallelConfig, "tensor_parallel_size"),
                   help="split the model's heads and MLP over this many processes, one GPU "
                        "each (cuda:0, cuda:1, ...; CPU processes on a CPU host); it must divide "
                        "the model's attention heads, KV heads and intermediate size")
    g.add_argument("--cuda-graph-max-batch", type=_positive_int,
                   default=_default(RunnerConfig, "cuda_graph_max_batch"),
                   help="largest decode batch captured in a CUDA graph (capped at "
                        "--max-num-seqs); larger decode steps run eagerly")
    g.add_argument("--piecewise-graph-max-tokens",
                   type=_runner_int("piecewise_graph_max_tokens",
                                    f"0 (off) or in [16, {MAX_PIECEWISE_GRAPH_TOKENS}]"),
                   default=_default(RunnerConfig, "piecewise_graph_max_tokens"),
                   help="other steps of at most this many tokens (prompts and chunks, decodes "
                        "beside them) replay each layer's norms and matmuls from CUDA graphs, "
                        "attention launched eagerly between them (default %(default)s; 0: off)")
    g.add_argument("--quantization", default=_default(RunnerConfig, "quantization"),
                   choices=["none", "fp8", "int8"],
                   help="fp8: W8A8, e4m3 weights per output channel and activations per token "
                        "(sm_89+ GPUs or the CPU); int8: weight-only, int8 weights per output "
                        "channel, activations in the model dtype")
    g.add_argument("--decode-overlap-min-batch", type=int,
                   default=_default(RunnerConfig, "decode_overlap_min_batch"),
                   help="decode batches of at least this many sequences run as two micro-batches "
                        "on two CUDA streams, one half's attention beside the other's MLP "
                        "(0, the default: never; it measured slower on an H200)")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads when running on the CPU (default: torch's, "
                        "capped at the CPUs this process may use: affinity and cgroup quota)")
    g.add_argument("--speculative-method", default=_default(SpeculativeConfig, "method"),
                   choices=list(SPEC_METHODS),
                   help="speculative decoding: ngram = prompt lookup (drafts the tokens that "
                        "followed the latest earlier occurrence of the sequence's suffix); "
                        "suffix = suffix decoding (suffix trees over the request and recent "
                        "outputs); draft_model = a smaller model of the same vocabulary "
                        "(--speculative-model) drafts greedily")
    g.add_argument("--speculative-config", type=_speculative_json, default=None,
                   metavar="JSON",
                   help="speculative decoding as vLLM spells it, a JSON object over the "
                        "single flags: method, num_speculative_tokens, model, "
                        "prompt_lookup_min/max, suffix_decoding_max_tree_depth, "
                        "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, "
                        "suffix_decoding_min_token_prob, calibration_max_batch, step_budget, "
                        "min_accepted_per_step, draft_gpu_memory_utilization (a model without "
                        "a method: draft_model)")
    g.add_argument("--speculative-model", default=_default(SpeculativeConfig, "model"),
                   help="the draft model for --speculative-method draft_model (a path or "
                        "dummy:<preset>)")
    g.add_argument("--speculative-draft-gpu-memory-utilization", type=float,
                   default=_default(SpeculativeConfig, "draft_gpu_memory_utilization"),
                   help="the draft model's share of the GPU's memory (weights and KV cache); "
                        "the target's KV cache is sized after it")
    g.add_argument("--num-speculative-tokens", type=int,
                   default=_default(SpeculativeConfig, "num_speculative_tokens"),
                   help="drafts per step at most (requests may ask for fewer)")
    g.add_argument("--prompt-lookup-min", type=_positive_int,
                   default=_default(SpeculativeConfig, "prompt_lookup_min"))
    g.add_argument("--prompt-lookup-max", type=_positive_int,
                   default=_default(SpeculativeConfig, "prompt_lookup_max"))
    g.add_argument("--pooling-type", default=_default(PoolerConfig, "pooling_type"),
                   choices=POOLING_TYPES,
                   help="embedding requests' default pooling: LAST (the last prompt position's "
                        "hidden state), MEAN (over the prompt) or CLS (the first position's); "
                        "default: the model's sentence-transformers configuration, else LAST")
    g.add_argument("--classifier-from-token", default="", metavar="TOKENS",
                   type=_classifier_tokens,
                   help="serve the model as a classifier / cross-encoder over its LM head's "
                        "rows for these comma-separated tokens, each one token; two (no,yes) "
                        "make one yes-minus-no score, as vLLM's classifier_from_token "
                        "(Qwen3-Reranker: no,yes)")
    g.add_argument("--spec-min-accepted-per-step", type=float,
                   default=_default(SpeculativeConfig, "min_accepted_per_step"),
                   help="a request whose verify steps accept fewer drafts than this per step "
                        "(moving average) pauses drafting for a few steps; with the step "
                        "budget, once verify steps are measured, the point where its drafts "
                        "stop paying for its batch lowers it where that is lower; 0: never "
                        "pauses")


def engine_config_from_args(args: argparse.Namespace, role: str = "colocated") -> EngineConfig:
    cache_kwargs: dict[str, Any] = {}
    if args.cpu_kv_cache_gb is not None:
        cache_kwargs["cpu_kv_cache_bytes"] = int(args.cpu_kv_cache_gb * (1 << 30))
    return EngineConfig(
        load=LoadConfig(model=args.model, load_format=args.load_format, dtype=args.dtype,
                        seed=args.seed, tokenizer=args.tokenizer),
        cache=CacheConfig(block_size=args.block_size,
                          enable_prefix_caching=args.enable_prefix_caching,
                          num_gpu_blocks=args.num_gpu_blocks,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_dtype=args.kv_cache_dtype, kv_scales=args.kv_scales,
                          block_allocation=args.block_allocation, **cache_kwargs),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=not args.no_chunked_prefill,
                                  max_model_len=args.max_model_len, role=role,  # type: ignore[arg-type]
                                  kv_lease_ms=args.kv_lease_ms,
                                  async_scheduling={"auto": None, "on": True, "off": False}[
                                      args.async_scheduling],
                                  gc_threshold=args.gc_threshold,
                                  policy=args.scheduling_policy,
                                  max_queued_requests=args.max_queued_requests),
        runner=RunnerConfig(device=args.device, attention_backend=args.attention_backend,
                            enforce_eager=args.enforce_eager, cpu_threads=args.cpu_threads,
                            cuda_graph_max_batch=args.cuda_graph_max_batch,
                            decode_overlap_min_batch=args.decode_overlap_min_batch,
                            piecewise_graph_max_tokens=args.piecewise_graph_max_tokens,
                            quantization=args.quantization),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        lora=LoRAConfig(modules=tuple(args.lora_modules), max_lora_rank=args.max_lora_rank,
                        max_loras=args.max_loras or (max(1, len(args.lora_modules))
                                                     if args.enable_lora else 0)),
        pooler=PoolerConfig(pooling_type=args.pooling_type,
                            classifier_from_token=args.classifier_from_token),
        speculative=_speculative(args),
    )


def _speculative(args: argparse.Namespace) -> SpeculativeConfig:
    """The single flags, with --speculative-config's fields over them."""
    base = SpeculativeConfig(method=args.speculative_method,
                             num_speculative_tokens=args.num_speculative_tokens,
                             prompt_lookup_min=args.prompt_lookup_min,
                             prompt_lookup_max=args.prompt_lookup_max,
                             min_accepted_per_step=args.spec_min_accepted_per_step,
                             model=args.speculative_model,
                             draft_gpu_memory_utilization=(
                                 args.speculative_draft_gpu_memory_utilization))
    text = getattr(args, "speculative_config", None)
    return base if text is None else parse_speculative_config(text, base)
