"""What one tensor-parallel rank holds of a Llama-family decoder (Megatron-LM's layout).

Column-parallel (each rank computes its slice of the outputs): the fused QKV projection (its
own query heads and KV heads), the fused gate/up projection (its own intermediate columns).
Row-parallel (each rank multiplies its slice of the inputs; the ranks' partial sums are added
by an all-reduce): the O projection and the down projection. A mixture of experts splits every
expert the same way (its gate/up columns, its down inputs). Everything else is replicated:
the embedding, the norms, the routers, the LM head (only rank 0 computes logits).

A rank's model is an ordinary model built from `shard_model_config` — the same architecture
with 1/n of the heads, KV heads and intermediate size — so attention, the KV cache's layout and
every kernel work on a shard unchanged; only weight loading (`shard_weight`) and the two
all-reduces per layer know about the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError, ModelConfig


@dataclass(frozen=True, slots=True)
class TensorShard:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    @property
    def is_split(self) -> bool:
        return self.size > 1


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ConfigError unless `cfg` splits evenly over `size` ranks (every rank keeps whole heads,
    whole KV heads and an equal share of the MLP)."""
    if size == 1:
        return
    for what, n in (("num_attention_heads", cfg.num_attention_heads),
                    ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size),
                    ("moe_intermediate_size", cfg.moe_intermediate_size),
                    ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if n % size:
            raise ConfigError(
                f"tensor_parallel_size {size} does not divide the model's {what} ({n}); "
                f"each rank must hold an equal share (try a divisor of {n})")


def shard_model_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The architecture one of `size` ranks builds: heads, KV heads and intermediate size
    divided by `size`; head_dim, hidden size and vocabulary unchanged."""
    check_shardable(cfg, size)
    if size == 1:
        return cfg
    return cfg.replace(num_attention_heads=cfg.num_attention_heads // size,
                       num_key_value_heads=cfg.num_key_value_heads // size,
                       intermediate_size=cfg.intermediate_size // size,
                       moe_intermediate_size=cfg.moe_intermediate_size // size,
                       shared_expert_intermediate_size=cfg.shared_expert_intermediate_size
                       // size)


# Hugging Face parameter names (suffixes) → the dimension a rank slices; absent: replicated.
_COLUMN = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")
_ROW = (".o_proj.", ".down_proj.")


def shard_weight(name: str, tensor: torch.Tensor, full: ModelConfig,
                 shard: TensorShard) -> torch.Tensor | None:
    """Rank `shard.rank`'s slice of the Hugging Face-named `tensor` of a model of architecture
    `full`. None for a row-parallel bias on ranks other than 0: the all-reduce would add it
    once per rank, so rank 0 alone keeps it (the others' is zero). Fused checkpoints (Phi-3:
    `qkv_proj`, `gate_up_proj`) are split into their parts, each part sliced."""
    if not shard.is_split:
        return tensor
    n, r = shard.size, shard.rank
    if any(key in name for key in _COLUMN):
        return tensor.chunk(n, dim=0)[r]
    if any(key in name for key in _ROW):
        if name.endswith(".bias"):
            return tensor if r == 0 else None
        return tensor.chunk(n, dim=1)[r]
    if ".qkv_proj." in name:
        q = full.num_attention_heads * full.head_dim
        kv = full.num_key_value_heads * full.head_dim
        parts = tensor.split([q, kv, kv], dim=0)
        return torch.cat([p.chunk(n, dim=0)[r] for p in parts])
    if ".gate_up_proj." in name:
        return torch.cat([p.chunk(n, dim=0)[r] for p in tensor.chunk(2, dim=0)])
    return tensor
