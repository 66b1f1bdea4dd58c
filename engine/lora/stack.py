"""Every loaded adapter's weights on the device, per decoder layer and fused projection, and
their application to one step's rows.

A fused projection (QKV: q | k | v; gate/up: gate | up) takes an adapter as one pair
`A_cat [in, R]`, `B_cat [R, out]`: the targeted parts' A stacked along the rank, their B
(times the adapter's scaling) placed block-diagonally at their output columns, zero where a
part is not targeted. So one adapter costs two thin matmuls per projection whatever it targets.

A step groups its rows by adapter (`LoRABatch`, built where the step's inputs are), and each
group adds `(x[rows] @ A_cat) @ B_cat` into the projection's output rows. Such a step runs
eagerly: its groups are data, not shapes a captured graph could hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.lora.adapter import LoRAAdapter, target_shape

# Fused projection -> its parts in output order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(slots=True)
class LoRABatch:
    """One step's rows that run an adapter: (adapter slot, row indices [n] on the device)."""

    groups: list[tuple[int, torch.Tensor]]


class LoRAStack:
    def __init__(self, adapters: list[LoRAAdapter], cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        """Slot i + 1 is `adapters[i]` (slot 0: no adapter)."""
        self.adapters = adapters
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}
        # [layer][fused] -> per slot (A_cat, B_cat) or None (the adapter leaves it alone)
        self.weights: list[dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]] = []
        for layer in range(cfg.num_hidden_layers):
            per_fused: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
            for fused, parts in FUSED_PARTS.items():
                slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None]
                slots.extend(_fuse(a, layer, parts, cfg, device, dtype) for a in adapters)
                per_fused[fused] = slots
            self.weights.append(per_fused)

    def slot(self, name: str) -> int:
        """KeyError for a name no loaded adapter has."""
        return self.slots[name]

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor,
              batch: LoRABatch) -> torch.Tensor:
        """y [T, out] (the base projection of x [T, in]) plus each group's delta, in place."""
        per_slot = self.weights[layer][fused]
        for slot, rows in batch.groups:
            w = per_slot[slot]
            if w is None:
                continue
            a, b = w
            delta = (x.index_select(0, rows) @ a) @ b
            y.index_add_(0, rows, delta.to(y.dtype))
        return y


def _fuse(adapter: LoRAAdapter, layer: int, parts: tuple[str, ...], cfg: ModelConfig,
          device: torch.device, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    present = [p for p in parts if (layer, p) in adapter.weights]
    if not present:
        return None
    n_in = target_shape(cfg, parts[0])[0]
    outs = [target_shape(cfg, p)[1] for p in parts]
    r = adapter.rank
    a_cat = torch.zeros(n_in, r * len(present))
    b_cat = torch.zeros(r * len(present), sum(outs))
    k = 0
    for part, offset in zip(parts, _offsets(outs), strict=True):
        if part not in present:
            continue
        a, b = adapter.weights[(layer, part)]
        a_cat[:, k * r:(k + 1) * r] = a.T
        b_cat[k * r:(k + 1) * r, offset:offset + b.shape[0]] = (b * adapter.scaling).T
        k += 1
    return a_cat.to(device, dtype), b_cat.to(device, dtype)


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out
