"""Every loaded adapter's weights on the device, per decoder layer and fused projection, and
their application to one step's rows.

A fused projection (QKV: q | k | v; gate/up: gate | up) takes an adapter as one pair
`A [in, R]`, `B [R, out]`: the targeted parts' A stacked along the rank, their B (times the
adapter's scaling) placed block-diagonally at their output columns, zero where a part is not
targeted. Every adapter's pair is then stacked once more, along the rank, into `A_all [in, C]`
and `B_all [C, out]`, with `col_slot [C]` naming each column's adapter. A step's rows carry their
adapter's slot (`LoRABatch.token_slots`, 0 for the base model), and a projection adds

    ((x @ A_all) * (token_slots[:, None] == col_slot)) @ B_all

— each row's own adapter's delta, exactly (the other columns are multiplied by zero): two thin
matmuls and a mask per projection whatever the mix of adapters in the step, with no shape that
depends on it, so decode steps with adapters replay CUDA graphs like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.lora.adapter import LoRAAdapter, target_shape
from engine.parallel.shard import TensorShard

# Fused projection -> its parts in output order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# Under tensor parallelism (engine/parallel/shard.py): a column-parallel projection's rank
# holds its slice of each part's outputs, so of each B; a row-parallel one's holds its slice of
# the inputs, so of A, and its partial delta joins the partial products the all-reduce adds
# (the mask is per element, so the ranks' partial deltas sum to the whole one).
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(slots=True)
class LoRABatch:
    """One step's rows' adapters: `token_slots [T]` (int64 on the device; 0: the base model)."""

    token_slots: torch.Tensor
    # Row x column masks made this step, by column layout (`LoRAStack` shares one layout
    # tensor between the projections of every layer that have it): made at the first layer,
    # reused by the others.
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, C]: 1 where the row's adapter owns the column, else 0."""
        m = self.masks.get(id(cols))
        if m is None:
            m = self.masks[id(cols)] = (self.token_slots[:, None] == cols[None, :]).to(dtype)
        return m


class LoRAStack:
    def __init__(self, adapters: list[LoRAAdapter], cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype, shard: TensorShard = TensorShard()) -> None:
        """Slot i + 1 is `adapters[i]` (slot 0: no adapter). `cfg`: the whole model's
        architecture; `shard`: this rank's share of each projection (tensor parallelism)."""
        self.adapters = adapters
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}
        # [layer][fused] -> (A_all [in, C], B_all [C, out], col_slot [C]), or None where no
        # adapter touches the projection.
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = []
        layouts: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # one tensor per layout
        for layer in range(cfg.num_hidden_layers):
            per_fused: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
            for fused, parts in FUSED_PARTS.items():
                pairs = [(slot, _fuse(a, layer, parts, cfg, shard, fused in ROW_PARALLEL))
                         for slot, a in enumerate(adapters, start=1)]
                present = [(slot, ab) for slot, ab in pairs if ab is not None]
                if not present:
                    per_fused[fused] = None
                    continue
                a_all = torch.cat([ab[0] for _, ab in present], dim=1)
                b_all = torch.cat([ab[1] for _, ab in present], dim=0)
                layout = tuple((slot, ab[0].shape[1]) for slot, ab in present)
                cols = layouts.get(layout)
                if cols is None:
                    cols = layouts[layout] = torch.cat(
                        [torch.full((width,), slot, dtype=torch.long) for slot, width in layout]
                    ).to(device)
                per_fused[fused] = (a_all.to(device, dtype), b_all.to(device, dtype), cols)
            self.weights.append(per_fused)

    def slot(self, name: str) -> int:
        """KeyError for a name no loaded adapter has."""
        return self.slots[name]

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor,
              batch: LoRABatch) -> torch.Tensor:
        """y [T, out] (the base projection of x [T, in]) plus each row's adapter's delta."""
        w = self.weights[layer][fused]
        if w is None:
            return y
        a_all, b_all, cols = w
        h = (x @ a_all).mul_(batch.mask(cols, x.dtype))
        return y.addmm_(h, b_all)


def _fuse(adapter: LoRAAdapter, layer: int, parts: tuple[str, ...], cfg: ModelConfig,
          shard: TensorShard, row_parallel: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The adapter's (A [in, R], B [R, out]) for one fused projection (float32, CPU) as rank
    `shard.rank` holds it, the scaling folded into B; None when it targets none of the parts."""
    present = [p for p in parts if (layer, p) in adapter.weights]
    if not present:
        return None
    n, rank = shard.size, shard.rank
    n_in = target_shape(cfg, parts[0])[0] // (n if row_parallel else 1)
    outs = [target_shape(cfg, p)[1] // (1 if row_parallel else n) for p in parts]
    r = adapter.rank
    a_cat = torch.zeros(n_in, r * len(present))
    b_cat = torch.zeros(r * len(present), sum(outs))
    k = 0
    for part, offset in zip(parts, _offsets(outs), strict=True):
        if part not in present:
            continue
        a, b = adapter.weights[(layer, part)]
        if row_parallel:
            a = a.chunk(n, dim=1)[rank]
        else:
            b = b.chunk(n, dim=0)[rank]
        a_cat[:, k * r:(k + 1) * r] = a.T
        b_cat[k * r:(k + 1) * r, offset:offset + b.shape[0]] = (b * adapter.scaling).T
        k += 1
    return a_cat, b_cat


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out
