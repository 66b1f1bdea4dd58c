"""Frozen configuration, layered by consumer (DESIGN.md §5).

CLI parsing happens only at the process edge (`engine/cli.py`); defaults live here. Numbers
discovered at run time (e.g. the number of KV blocks after memory profiling) live in
`engine.runner.RunnerResult`, never written back into these objects.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Role = Literal["colocated", "prefill", "decode"]
BlockAllocation = Literal["auto", "lru", "runs"]
BLOCK_ALLOCATIONS: tuple[BlockAllocation, ...] = get_args(BlockAllocation)
AttentionBackendName = Literal["torch", "triton", "auto"]
KvCacheDtype = Literal["auto", "fp8", "int8"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Phi-3/Phi-4,
    SmolLM2), or of one whose MLPs are mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE).

    Field names follow Hugging Face `config.json` so `from_hf_dict` is a thin mapping.
    """

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` dict as a sorted tuple of items (hashable); None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style q/k/v bias
    qk_norm: bool = False         # Qwen3-style RMSNorm over each head of q and k, before RoPE
    mlp_bias: bool = False
    # Mistral v0.1-style sliding-window attention; only exact while contexts fit the window.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0: every MLP is dense. A sparse
    # layer's router picks num_experts_per_tok experts per token out of num_experts, each a
    # SiLU-gated MLP of moe_intermediate_size; norm_topk_prob renormalises the picked experts'
    # softmax weights to sum to 1. Qwen3-MoE keeps dense MLPs (intermediate_size) in the
    # layers `mlp_only_layers` names and those not on the decoder_sparse_step grid.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a dense SiLU-gated MLP of this size beside the routed experts, its output
    # scaled by sigmoid(shared_expert_gate · x) (0: none).
    shared_expert_intermediate_size: int = 0
    # Identity of the weights (path + size + mtime, or "dummy:<seed>"); part of the fingerprint.
    weights_id: str = ""

    SUPPORTED_ARCHITECTURES = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    )
    MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], weights_id: str = "") -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in cls.SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json: architecture {arch!r} is not supported; "
                f"supported: {', '.join(cls.SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise ConfigError(f"config.json: {key} must be a positive integer, got {d.get(key)!r}")
        n_heads = d["num_attention_heads"]
        n_kv = d.get("num_key_value_heads") or n_heads
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rs = d.get("rope_scaling")
        rope_theta = d.get("rope_theta", 10000.0)
        rp = d.get("rope_parameters")  # transformers >= 5 keeps theta and scaling here
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rs = {k: v for k, v in rp.items() if k != "rope_theta"}
        rope_scaling = tuple(sorted(rs.items())) if isinstance(rs, dict) else None
        for partial in (d.get("partial_rotary_factor"),
                        rp.get("partial_rotary_factor") if isinstance(rp, dict) else None):
            if partial is not None and float(partial) != 1.0:  # Phi-4-mini rotates 3/4
                raise ConfigError(f"config.json: partial_rotary_factor {partial} is not "
                                  "supported (every head dimension is rotated)")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {d['hidden_act']!r} is not supported "
                              "(the MLP is SiLU-gated)")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        moe = _moe_fields(arch, d)
        cfg = cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2-MoE names its q/k/v bias `qkv_bias` (on unless said otherwise).
            attention_bias=bool(d.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM"
                                else d.get("attention_bias", is_qwen2)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=(int(d["sliding_window"]) if d.get("sliding_window")
                            and d.get("use_sliding_window", True) else None),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            weights_id=weights_id,
            **moe,
        )
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent HF config dict (used to build the `transformers` reference in tests)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
                           "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                           "Qwen3MoeForCausalLM": "qwen3_moe"}.get(self.architecture, "llama"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if self.eos_token_ids else None,
        }
        if self.is_moe:
            d.update(num_local_experts=self.num_experts, num_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok)
            if self.architecture != "MixtralForCausalLM":
                d.update(moe_intermediate_size=self.moe_intermediate_size,
                         norm_topk_prob=self.norm_topk_prob,
                         decoder_sparse_step=self.decoder_sparse_step,
                         mlp_only_layers=list(self.mlp_only_layers))
            if self.architecture == "Qwen2MoeForCausalLM":
                d.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                         qkv_bias=self.attention_bias)
        return d

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be a positive even integer, got {self.head_dim}")
        if self.qk_norm != (self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")):
            raise ConfigError(f"qk_norm is Qwen3's (architecture {self.architecture!r})")
        if self.is_moe != (self.architecture in self.MOE_ARCHITECTURES):
            raise ConfigError(f"num_experts {self.num_experts}: architecture "
                              f"{self.architecture!r} is "
                              f"{'' if self.is_moe else 'not '}a mixture of experts")
        if self.is_moe:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok must be in [1, num_experts "
                                  f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError("moe_intermediate_size and decoder_sparse_step must be "
                                  "positive")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx`'s MLP is a mixture of experts (Qwen3-MoE's rule:
        not in `mlp_only_layers` and on the `decoder_sparse_step` grid)."""
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def fused_checkpoint(self) -> bool:
        """Whether checkpoints hold the fused `qkv_proj` and `gate_up_proj` (Phi-3) rather
        than q/k/v and gate/up apart."""
        return self.architecture == "Phi3ForCausalLM"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from an HF config dict (empty for a dense
    architecture). Mixtral's experts are `intermediate_size` wide and always renormalised;
    Qwen2- and Qwen3-MoE name `moe_intermediate_size` and say whether to renormalise; Qwen2-MoE
    adds a gated shared expert."""
    if arch not in ModelConfig.MOE_ARCHITECTURES:
        return {}
    experts = d.get("num_experts") or d.get("num_local_experts")
    top_k = d.get("num_experts_per_tok")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    if arch == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": True}
    inter = d.get("moe_intermediate_size")
    if not isinstance(inter, int) or inter <= 0:
        raise ConfigError(f"config.json: moe_intermediate_size must be a positive integer, "
                          f"got {inter!r}")
    shared = d.get("shared_expert_intermediate_size") or 0
    if shared and arch != "Qwen2MoeForCausalLM":
        raise ConfigError(f"config.json: shared_expert_intermediate_size is Qwen2-MoE's, not "
                          f"{arch}'s")
    if not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config.json: shared_expert_intermediate_size must be a "
                          f"non-negative integer, got {shared!r}")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, "
                          f"got {only!r}")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": inter,
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(sorted(only)),
            "shared_expert_intermediate_size": shared}


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Where the weights come from."""

    model: str = ""              # path to HF dir / .gguf file, or "dummy:<preset>"; "" = default
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    seed: int = 0                # for dummy weights
    tokenizer: str | None = None  # override tokenizer path


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None   # None: sized by memory profiling
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_bytes: int = 2 << 30   # KV budget when running on the CPU
    # "fp8": float8 e4m3 storage with per-layer K/V scales (half the bytes of bf16); "int8":
    # int8 storage with per-layer K/V scales from a calibration pass (engine/attention/
    # kv_calibration.py), for GPUs without fp8 conversions (Ampere) or an int8 pipeline.
    kv_cache_dtype: KvCacheDtype = "auto"
    # Where a quantized cache's scales come from: None = the dtype's default (fp8: 1.0,
    # int8: "calibrate"), "calibrate" (a prefill of a fixed text at start-up), or the path of
    # a JSON file (`splitserve kv-scales` writes one).
    kv_scales: str | None = None
    tenant_salt: str = ""
    # Which free blocks are handed out: "lru" (least recently freed first), "runs" (prompts
    # kept in runs of consecutive ids, RunKeepingBlockPool: a KV handoff copies one run at a
    # time), "auto" (runs for the prefill and decode roles, whose prompts' KV is copied between
    # caches; lru for colocated engines).
    block_allocation: BlockAllocation = "auto"

    def validate(self) -> None:
        if self.block_allocation not in BLOCK_ALLOCATIONS:
            raise ConfigError(f"block_allocation must be one of {', '.join(BLOCK_ALLOCATIONS)}, "
                              f"got {self.block_allocation!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ConfigError(f"kv_cache_dtype must be 'auto' (the model dtype), 'fp8' "
                              f"(float8 e4m3) or 'int8', got {self.kv_cache_dtype!r}")
        if self.kv_scales is not None and self.kv_cache_dtype == "auto":
            raise ConfigError("kv_scales applies to a quantized cache (kv_cache_dtype fp8 or "
                              "int8), not to 'auto'")
        if self.kv_scales is not None and not self.kv_scales.strip():
            raise ConfigError("kv_scales must be 'calibrate' or the path of a JSON file")
        if self.num_gpu_blocks is not None and (type(self.num_gpu_blocks) is not int
                                                or self.num_gpu_blocks < 1):
            raise ConfigError(f"num_gpu_blocks must be an integer >= 1 (or unset: sized from "
                              f"memory), got {self.num_gpu_blocks!r}")


# CPython's default thresholds (700, 10, 10) run a full collection every ~100 young ones, and a
# full collection walks every live request's token lists: ~30 ms for 1,000 requests of 2,000
# tokens on this project's CPU (bench/probe_gc.py), and 43-44 of them in an offline 1000 x 1000
# run on the H200 (1.5-3.4 s, probe_tput_fp8_768g_*.json -> gc). Young collections stay
# as they were; a full one waits for 1,000 middle-generation collections instead of 10 (as
# SGLang's --gc-threshold and other engines raise them). Cycles that reach the old generation
# live longer; the engine makes few.
DEFAULT_GC_THRESHOLD = (700, 10, 1000)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching and chunked prefill."""

    max_num_seqs: int = 256                 # max requests in one step
    max_num_batched_tokens: int = 2048      # token budget of one step
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None        # None: the model's max_position_embeddings
    role: Role = "colocated"
    kv_lease_ms: int = 30_000               # prefill role: how long KV is held for decode
    # Schedule and launch step n+1 while the GPU still runs step n (sampled tokens stay on the
    # device as the next inputs). None: on for CUDA devices, except in the prefill role.
    async_scheduling: bool | None = None
    # The garbage collector's thresholds for the engine's process (gc.set_threshold), set when
    # the engine starts; None leaves the interpreter's (DEFAULT_GC_THRESHOLD says why).
    gc_threshold: tuple[int, int, int] | None = DEFAULT_GC_THRESHOLD

    def validate(self) -> None:
        t = self.gc_threshold
        if t is not None and (len(t) != 3 or any(type(x) is not int or x < 0 for x in t)):
            raise ConfigError(f"gc_threshold must be three integers >= 0, got {t!r}")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How the forward pass runs."""

    device: str = "auto"                    # "auto": cuda if available else cpu
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False             # True: no CUDA graphs
    # Largest decode batch captured in a CUDA graph (and not above max_num_seqs); bigger
    # decode steps run eagerly. 512 as in vLLM: each bucket costs capture time and pool memory.
    cuda_graph_max_batch: int = 512
    # Decode steps of at least this many sequences run as two micro-batches on two CUDA
    # streams, one half's attention beside the other's MLP (engine/model/overlap.py). 0: never,
    # the default: on the H200 it measured slower (docs/performance.md).
    decode_overlap_min_batch: int = 0
    quantization: Literal["none", "fp8", "int8"] = "none"
    # Intra-op threads on the CPU; None keeps torch's default. Several engines (or an engine and
    # its tests) on one small machine must split the cores, or spinning thread pools oversubscribe
    # them and small ops get ~100x slower.
    cpu_threads: int | None = None
    # Other steps of at most this many tokens (prompts and chunks, decodes beside them) replay
    # piecewise CUDA graphs: each layer's norms, matmuls, RoPE and KV write from a graph per
    # token-count bucket, attention launched eagerly between them (engine/piecewise_graphs.py).
    # On the H200 (8B): a prompt's first token 15-17 ms eager -> 5.3-12.2 ms for 5-512 tokens.
    # 0: off.
    piecewise_graph_max_tokens: int = 512

    def validate(self) -> None:
        n = self.piecewise_graph_max_tokens
        if type(n) is not int or not (n == 0 or 16 <= n <= MAX_PIECEWISE_GRAPH_TOKENS):
            raise ConfigError(f"piecewise_graph_max_tokens must be 0 (off) or in "
                              f"[16, {MAX_PIECEWISE_GRAPH_TOKENS}], got {n!r}")


# Past ~2k tokens a step's kernels outlast its eager launches (a 1,024-token prompt: 20.5 ms of
# kernels against ~2 ms of gaps on the H200), so graphs gain nothing and cost pool memory.
MAX_PIECEWISE_GRAPH_TOKENS = 2048


SpecMethod = Literal["none", "ngram", "draft_model"]
SPEC_METHODS: tuple[SpecMethod, ...] = get_args(SpecMethod)  # "none" first

# Each draft is one more query row per sequence in the verify step; beyond a handful the
# acceptance of the last drafts is small and the step's extra rows cost more than they save.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/): a proposer drafts tokens, the target model verifies
    them all in one step, and a rejection sampler keeps the target's distribution exactly.

    `method` enables the capability; each request may then ask for fewer drafts, or none (the
    gateway turns it off under load). "ngram" is prompt lookup: the longest suffix of the
    sequence, `prompt_lookup_max` down to `prompt_lookup_min` tokens long, that occurred earlier
    proposes the tokens that followed it (vLLM's `ngram` method). "draft_model" runs `model`, a
    smaller model with the target's vocabulary, greedily for the drafts (vLLM's draft model;
    engine/spec/draft_model.py); it runs on the target's device with its own KV cache."""

    method: SpecMethod = "none"
    num_speculative_tokens: int = 4     # drafts per step at most
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # A request whose verify steps recently accepted fewer drafts than this per step (moving
    # average) pauses drafting for SPEC_PROBE_INTERVAL steps, then tries again: below it a
    # verify step costs more than the tokens it saves. Measured break-even with 4 drafts: 0.32
    # on an H200 at batch 1 (a verify step costs 1.32 decode steps,
    # bench/results/h200/ab_verify_decode_*_6f732f8.json), 0.53 on this project's CPU
    # (bench/results/cpu_probe_spec_smollm2.json). 0: never pause.
    min_accepted_per_step: float = 0.4
    # method "draft_model": the draft's weights (a path, or "dummy:<preset>" as for the target).
    model: str = ""
    # The draft's share of the device's memory (its weights, activations and KV cache; the
    # target's KV cache is sized after it). Ignored on the CPU, where the draft's cache takes
    # `CacheConfig.cpu_kv_cache_bytes` as the target's does.
    draft_gpu_memory_utilization: float = 0.1

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError("speculative method must be 'none', 'ngram' or 'draft_model', got "
                              f"{self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative method 'draft_model' needs the draft's `model` (a path "
                              "or dummy:<preset>)")
        if not 0.0 < self.draft_gpu_memory_utilization < 1.0:
            raise ConfigError("draft_gpu_memory_utilization must be in (0, 1), got "
                              f"{self.draft_gpu_memory_utilization!r}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                              f"got {self.num_speculative_tokens}")
        floor = self.min_accepted_per_step
        if not isinstance(floor, (int, float)) or not 0 <= floor <= self.num_speculative_tokens:
            raise ConfigError("min_accepted_per_step must be in [0, num_speculative_tokens], got "
                              f"{self.min_accepted_per_step!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("prompt lookup n-gram sizes must satisfy 1 <= prompt_lookup_min <= "
                              f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                              f"{self.prompt_lookup_max}")


# Adapters' ranks above this are refused (vLLM's --max-lora-rank default is 16; PEFT adapters in
# use rarely exceed 64, and each rank costs every adapted row two thin matmuls per projection).
DEFAULT_MAX_LORA_RANK = 64
_LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (engine/lora/): PEFT adapters loaded at start, each request choosing
    one by name (or none) — vLLM's `--enable-lora --lora-modules name=path`. The adapters'
    deltas are added to the projections they target (q/k/v/o, gate/up/down) for the rows of
    the requests that chose them; every other row computes the base model."""

    modules: tuple[tuple[str, str], ...] = ()  # (name, adapter directory)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    @property
    def enabled(self) -> bool:
        return bool(self.modules)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.modules)

    def validate(self) -> None:
        if type(self.max_lora_rank) is not int or not 1 <= self.max_lora_rank <= 1024:
            raise ConfigError(f"max_lora_rank must be an integer in [1, 1024], got "
                              f"{self.max_lora_rank!r}")
        seen: set[str] = set()
        for name, path in self.modules:
            if not isinstance(name, str) or not _LORA_NAME.match(name):
                raise ConfigError(f"LoRA adapter name {name!r} must be 1-128 characters of "
                                  "letters, digits and . _ : - (starting with a letter or digit)")
            if name in seen:
                raise ConfigError(f"LoRA adapter name {name!r} is given twice")
            if not isinstance(path, str) or not path:
                raise ConfigError(f"LoRA adapter {name!r} needs a directory")
            seen.add(name)


# Beyond a host's GPUs; a ceiling that catches a typo before it spawns processes.
MAX_TENSOR_PARALLEL_SIZE = 16


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism (engine/parallel/): the model's attention heads and MLP columns split
    over `tensor_parallel_size` processes, one device each (`cuda:0` … on a GPU host; CPU
    processes otherwise), as Megatron-LM lays a decoder out and vLLM's `--tensor-parallel-size`
    does. The engine's process is rank 0: it schedules, samples and holds its own shard; the
    other ranks are worker processes that run each forward pass on theirs."""

    tensor_parallel_size: int = 1
    # How long a collective (a step's all-reduce, a command's broadcast) may wait for the other
    # ranks before it fails instead of hanging: a dead or stuck worker turns into an error.
    collective_timeout_s: float = 300.0

    @property
    def layout(self) -> str:
        """The layout of the KV blocks the engine hands out, in the model fingerprint
        (DESIGN.md §4): every KV head of a layer in the model's order, whatever the
        tensor-parallel size — a split cache's blocks are gathered whole as they leave and
        scattered to the ranks as they enter (engine/parallel/). So workers of different sizes
        share KV: a prefill worker at tp 4 hands its prompts to a decode worker at tp 1."""
        return "heads-whole"

    def validate(self) -> None:
        n = self.tensor_parallel_size
        if type(n) is not int or not 1 <= n <= MAX_TENSOR_PARALLEL_SIZE:
            raise ConfigError(f"tensor_parallel_size must be an integer in "
                              f"[1, {MAX_TENSOR_PARALLEL_SIZE}], got {n!r}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got "
                              f"{self.collective_timeout_s!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def keeps_block_runs(self) -> bool:
        """Whether the KV pool keeps prompts in runs of consecutive blocks (CacheConfig's
        `block_allocation`; "auto": where KV is handed to or from another cache)."""
        mode = self.cache.block_allocation
        return mode == "runs" or (mode == "auto" and self.scheduler.role != "colocated")
