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

Two layouts of the columns:
- packed (adapters fixed at start): only the adapters' own columns, only in the projections
  some adapter targets — the least work per step;
- slotted (`max_loras` > 0, vLLM's `--max-loras`): every projection of every layer holds
  `max_loras` blocks of `parts × max_rank` columns, slot s owning block s - 1, zero until an
  adapter is written into it. Adapters are then loaded and unloaded at runtime by writing
  their block in place: no tensor moves, so the captured graphs see the new weights.
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
# Steps up to this many rows (decode and verify steps, short prompts) expand through the Triton
# kernel when the stack has it; longer ones through torch, where three kernels' launches are
# nothing beside the step and cuBLAS reads B once.
KERNEL_MAX_ROWS = 1024


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
                 dtype: torch.dtype, shard: TensorShard = TensorShard(), max_loras: int = 0,
                 max_rank: int = 0, use_kernel: bool = False) -> None:
        """Slot i + 1 is `adapters[i]` (slot 0: no adapter). `cfg`: the whole model's
        architecture; `shard`: this rank's share of each projection (tensor parallelism).
        `max_loras` > 0: the slotted layout, room for that many adapters of rank up to
        `max_rank`, `adapters` written into the first slots and more added by `add`.
        `use_kernel`: steps of up to KERNEL_MAX_ROWS rows expand through the Triton kernel
        (engine/kernels/lora.py: one kernel where torch takes three)."""
        self.cfg, self.shard, self.device, self.dtype = cfg, shard, device, dtype
        self.use_kernel = use_kernel
        self.max_loras, self.max_rank = max_loras, max_rank
        self.loaded: dict[int, LoRAAdapter] = {}  # slot -> adapter
        self.slots: dict[str, int] = {}  # adapter name -> slot
        # [layer][fused] -> (A_all [in, C], B_all [C, out], col_slot [C]), or None where no
        # adapter touches the projection.
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]]
        if max_loras:
            if len(adapters) > max_loras:
                raise ValueError(f"{len(adapters)} adapters for {max_loras} slots")
            self.weights = self._slotted_weights()
            for adapter in adapters:
                self.add(adapter)
        else:
            self.weights = self._packed_weights(adapters)
            for slot, adapter in enumerate(adapters, start=1):
                self.loaded[slot] = adapter
                self.slots[adapter.name] = slot

    @property
    def adapters(self) -> list[LoRAAdapter]:
        """The loaded adapters, by slot."""
        return [self.loaded[s] for s in sorted(self.loaded)]

    @property
    def slotted(self) -> bool:
        """Whether adapters can be added and removed (the slotted layout)."""
        return self.max_loras > 0

    def slot(self, name: str) -> int:
        """KeyError for a name no loaded adapter has."""
        return self.slots[name]

    def add(self, adapter: LoRAAdapter) -> int:
        """Write `adapter` into a free slot and return the slot; ValueError when it cannot be
        (packed layout, name taken, no free slot, rank above the slots')."""
        if not self.slotted:
            raise ValueError("adapters are fixed at start (no max_loras slots)")
        if adapter.name in self.slots:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above the "
                             f"slots' {self.max_rank}")
        free = [s for s in range(1, self.max_loras + 1) if s not in self.loaded]
        if not free:
            raise ValueError(f"all {self.max_loras} LoRA slots are taken "
                             f"({', '.join(sorted(self.slots))}); unload one or raise max_loras")
        slot = free[0]
        for layer, per_fused in enumerate(self.weights):
            for fused, w in per_fused.items():
                assert w is not None  # every projection has columns in the slotted layout
                cols = self._block(slot, fused)
                w[0][:, cols].zero_()
                w[1][cols, :].zero_()
                ab = _fuse(adapter, layer, FUSED_PARTS[fused], self.cfg, self.shard,
                           fused in ROW_PARALLEL)
                if ab is not None:
                    width = ab[0].shape[1]
                    w[0][:, cols.start:cols.start + width].copy_(ab[0])
                    w[1][cols.start:cols.start + width, :].copy_(ab[1])
        self.loaded[slot] = adapter
        self.slots[adapter.name] = slot
        return slot

    def remove(self, name: str) -> int:
        """Free adapter `name`'s slot (zeroing its columns) and return it; KeyError when no
        loaded adapter has the name. The caller makes sure no running row uses it."""
        slot = self.slots.pop(name)
        del self.loaded[slot]
        if self.slotted:
            for per_fused in self.weights:
                for fused, w in per_fused.items():
                    assert w is not None
                    cols = self._block(slot, fused)
                    w[0][:, cols].zero_()
                    w[1][cols, :].zero_()
        return slot

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor,
              batch: LoRABatch) -> torch.Tensor:
        """y [T, out] (the base projection of x [T, in]) plus each row's adapter's delta."""
        w = self.weights[layer][fused]
        if w is None:
            return y
        a_all, b_all, cols = w
        h = x @ a_all
        if self.use_kernel and x.shape[0] <= KERNEL_MAX_ROWS and y.stride(-1) == 1:
            from engine.kernels import lora_expand

            return lora_expand(h, b_all, cols, batch.token_slots, y)
        return y.addmm_(h.mul_(batch.mask(cols, x.dtype)), b_all)

    def _block(self, slot: int, fused: str) -> slice:
        """Slot `slot`'s columns of projection `fused` in the slotted layout."""
        width = len(FUSED_PARTS[fused]) * self.max_rank
        return slice((slot - 1) * width, slot * width)

    def _slotted_weights(self) -> list[dict[str, tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor] | None]]:
        """Zeros for `max_loras` slots in every projection; one column-owner tensor per fused
        kind (the masks are made once per step for each)."""
        n = self.shard.size
        cols: dict[str, torch.Tensor] = {}
        shapes: dict[str, tuple[int, int]] = {}
        for fused, parts in FUSED_PARTS.items():
            row = fused in ROW_PARALLEL
            shapes[fused] = (target_shape(self.cfg, parts[0])[0] // (n if row else 1),
                             sum(target_shape(self.cfg, p)[1] // (1 if row else n)
                                 for p in parts))
            width = len(parts) * self.max_rank
            cols[fused] = torch.arange(1, self.max_loras + 1).repeat_interleave(width).to(
                self.device)
        out: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = []
        for _ in range(self.cfg.num_hidden_layers):
            per_fused: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
            for fused, (n_in, n_out) in shapes.items():
                c = cols[fused].shape[0]
                per_fused[fused] = (
                    torch.zeros(n_in, c, device=self.device, dtype=self.dtype),
                    torch.zeros(c, n_out, device=self.device, dtype=self.dtype), cols[fused])
            out.append(per_fused)
        return out

    def _packed_weights(self, adapters: list[LoRAAdapter]) -> list[dict[
            str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]]:
        """Only `adapters`' columns, only where one of them targets the projection."""
        out: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = []
        layouts: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # one tensor per layout
        for layer in range(self.cfg.num_hidden_layers):
            per_fused: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
            for fused, parts in FUSED_PARTS.items():
                pairs = [(slot, _fuse(a, layer, parts, self.cfg, self.shard,
                                      fused in ROW_PARALLEL))
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
                    ).to(self.device)
                per_fused[fused] = (a_all.to(self.device, self.dtype),
                                    b_all.to(self.device, self.dtype), cols)
            out.append(per_fused)
        return out


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
