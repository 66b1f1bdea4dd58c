"""Frozen configuration, layered by consumer (docs/architecture.md, "Engine internals"): one module per consumer
(`model`, `hf`, `cache`, `scheduler`, `runner`, `speculative`, `lora`, `parallel`), and
`EngineConfig`, which holds one of each. `from engine.config import X` is the public path.

CLI parsing happens only at the process edge (`engine/cli.py`); defaults live here. Numbers
discovered at run time (e.g. the number of KV blocks after memory profiling) live in
`engine.runner.RunnerResult`, never written back into these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config.cache import (
    BLOCK_ALLOCATIONS,
    BlockAllocation,
    CacheConfig,
    KvCacheDtype,
    kv_cache_dtype_name,
)
from engine.config.hf import (
    CLASSIFIER_SUFFIX,
    FULL,
    GEMMA_ARCHITECTURES,
    HIDDEN_ACTS,
    LAYER_TYPES_ARCHITECTURES,
    MAX_CLASS_LABELS,
    QK_NORM_ARCHITECTURES,
    QWEN_WINDOW_ARCHITECTURES,
    SLIDING,
    TEXT_ONLY_ARCHITECTURES,
    HiddenAct,
    class_labels,
    hf_architecture,
    language_model_dict,
)
from engine.config.lora import (
    DEFAULT_MAX_LORA_RANK,
    MAX_LORAS,
    LoRAConfig,
)
from engine.config.model import (
    LoadConfig,
    ModelConfig,
)
from engine.config.parallel import (
    MAX_TENSOR_PARALLEL_SIZE,
    ParallelConfig,
)
from engine.config.runner import (
    MAX_PIECEWISE_GRAPH_TOKENS,
    AttentionBackendName,
    RunnerConfig,
)
from engine.config.scheduler import (
    DEFAULT_GC_THRESHOLD,
    Role,
    SchedulerConfig,
    SchedulingPolicy,
)
from engine.config.speculative import (
    MAX_SPECULATIVE_TOKENS,
    SPEC_METHODS,
    SpecMethod,
    SpeculativeConfig,
    parse_speculative_config,
    speculative_config_from_dict,
)
from engine_api.errors import ConfigError
from engine_api.pooling_params import PoolerConfig

__all__ = [
    "BLOCK_ALLOCATIONS",
    "CLASSIFIER_SUFFIX",
    "DEFAULT_GC_THRESHOLD",
    "DEFAULT_MAX_LORA_RANK",
    "FULL",
    "GEMMA_ARCHITECTURES",
    "HIDDEN_ACTS",
    "LAYER_TYPES_ARCHITECTURES",
    "MAX_CLASS_LABELS",
    "MAX_LORAS",
    "MAX_PIECEWISE_GRAPH_TOKENS",
    "MAX_SPECULATIVE_TOKENS",
    "MAX_TENSOR_PARALLEL_SIZE",
    "QK_NORM_ARCHITECTURES",
    "QWEN_WINDOW_ARCHITECTURES",
    "SLIDING",
    "SPEC_METHODS",
    "TEXT_ONLY_ARCHITECTURES",
    "AttentionBackendName",
    "BlockAllocation",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "HiddenAct",
    "KvCacheDtype",
    "LoRAConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "PoolerConfig",
    "Role",
    "RunnerConfig",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpecMethod",
    "SpeculativeConfig",
    "class_labels",
    "hf_architecture",
    "kv_cache_dtype_name",
    "language_model_dict",
    "parse_speculative_config",
    "speculative_config_from_dict",
]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    pooler: PoolerConfig = field(default_factory=PoolerConfig)

    def keeps_block_runs(self) -> bool:
        """Whether the KV pool keeps prompts in runs of consecutive blocks (CacheConfig's
        `block_allocation`; "auto": where KV is handed to or from another cache)."""
        mode = self.cache.block_allocation
        return mode == "runs" or (mode == "auto" and self.scheduler.role != "colocated")
