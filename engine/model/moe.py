"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks `num_experts_per_tok` of
`num_experts` SiLU-gated MLPs per token and sums their outputs weighted by the router's
softmax (renormalised over the picked experts when `norm_topk_prob`); Qwen2-MoE adds a shared
expert every token runs, gated per token.

The experts' weights are stacked, `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows,
then its up rows) and `experts.down_proj` [E, H, I], the layout `transformers` keeps them in.
On the GPU path two grouped GEMMs run every (token, expert) pair at once
(`engine/kernels/fused_moe.py`, CUDA-graph safe); the torch path loops over the experts a step
picked, which is the reference the kernels are checked against.

Tensor parallelism splits every expert's intermediate columns like a dense MLP's (gate/up
column-parallel, down row-parallel, one all-reduce); the router is replicated, and every rank
routes the same tokens to the same experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import Linear, silu_and_mul
from engine.parallel.group import all_reduce_
from engine.parallel.shard import TensorShard

if TYPE_CHECKING:  # the kernels import Triton: only on the fast path
    from engine.kernels.fused_moe import MoETile, PairLayout


def route(logits: torch.Tensor, top_k: int, renormalise: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of router logits [T, E]: softmax in float32,
    the k largest, renormalised to sum to 1 when asked (as `transformers` routes)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: each picked expert's MLP over its tokens, weighted, summed per token in
    float32. x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; weights, ids: [T, k]. With scales
    ([E, 2I], [E, H]) the weights are int8 (W8A16): each output channel's products times its
    scale, in float32 (as `Int8Linear` computes)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids).tolist():  # reads ids on the host: eager only
        token, pick = torch.nonzero(ids == expert, as_tuple=True)
        h = _expert_linear(x[token], gate_up[expert],
                           None if gate_up_scale is None else gate_up_scale[expert])
        y = _expert_linear(silu_and_mul(h), down[expert],
                           None if down_scale is None else down_scale[expert])
        out.index_add_(0, token, y.float() * weights[token, pick, None])
    return out.to(x.dtype)


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None
                   ) -> torch.Tensor:
    if scale is None:
        return nn.functional.linear(x, weight)
    return (nn.functional.linear(x.float(), weight.float()) * scale).to(x.dtype)


def experts_fused(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None,
                  layout: PairLayout | None = None,
                  tiles: tuple[MoETile, MoETile] | None = None) -> torch.Tensor:
    """`experts_torch` as two Triton grouped GEMMs around SiLU-and-mul: no host reads.
    `layout` and `tiles` (gate/up's, down's) override the kernels' own choice (sweeps)."""
    from engine.kernels import silu_and_mul as fused_silu_and_mul
    from engine.kernels.fused_moe import layout_for, moe_gemm
    tokens, top_k = ids.shape
    layout = layout or layout_for(ids, gate_up.shape[0])
    first, second = tiles or (None, None)
    h = moe_gemm(x, gate_up, layout, top_k, gather_tokens=True, tile=first,
                 weight_scale=gate_up_scale)
    y = moe_gemm(fused_silu_and_mul(h), down, layout, top_k, gather_tokens=False,
                 routing_weights=weights.reshape(-1).contiguous(), tile=second,
                 weight_scale=down_scale)
    return y.view(tokens, top_k, -1).sum(dim=1)


class MoEExperts(nn.Module):
    """The stacked experts' weights (names as `transformers` keeps them); after
    `quantize_int8`, int8 with a float32 scale per expert and output channel."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate_up_scale: torch.Tensor | None
    down_scale: torch.Tensor | None

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.register_buffer("gate_up_scale", None, persistent=False)
        self.register_buffer("down_scale", None, persistent=False)

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """W8A16 (`--quantization int8`), as `Int8Linear` quantizes a dense projection:
        symmetric, per output channel of each expert."""
        from engine.model.quant import quantize_weight_int8
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name)
            experts, rows, cols = w.shape
            q, scale = quantize_weight_int8(w.detach().reshape(experts * rows, cols))
            delattr(self, name)
            self.register_buffer(name, q.view(experts, rows, cols), persistent=False)
            self.register_buffer(name.replace("_proj", "_scale"), scale.view(experts, rows),
                                 persistent=False)


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SiLU-gated MLP (gate/up fused, as the dense MLP's) whose
    output is scaled per token by sigmoid(shared_expert_gate · x). Under tensor parallelism it
    returns this rank's partial sum, which the block's all-reduce adds with the experts'."""

    def __init__(self, hidden: int, inter: int, use_triton: bool) -> None:
        super().__init__()
        self.use_triton = use_triton
        self.gate_up_proj = Linear(hidden, 2 * inter, False)
        self.down_proj = Linear(inter, hidden, False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(silu_and_mul(self.gate_up_proj(x), self.use_triton))
        return y * torch.sigmoid(gate)


class SparseMoeBlock(nn.Module):
    """Router + experts in place of a decoder layer's dense MLP. `cfg`: this rank's
    architecture (with tensor parallelism, 1/n of `moe_intermediate_size`)."""

    def __init__(self, cfg: ModelConfig, use_triton: bool, shard: TensorShard = TensorShard()
                 ) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalise = cfg.norm_topk_prob
        self.reduce = shard.is_split
        self.use_triton = use_triton
        # The routing and expert functions of this path, resolved once (forward is a step's
        # hot path): the Triton kernels, or the torch reference.
        self._route: Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]
        self._experts: Callable[..., torch.Tensor]
        if use_triton:
            from engine.kernels.fused_moe import route_topk
            self._route, self._experts = route_topk, experts_fused
        else:
            self._route, self._experts = route, experts_torch
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False)
        self.experts = MoEExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size,
                                              cfg.shared_expert_intermediate_size, use_triton)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self._route(self.gate(x), self.top_k, self.renormalise)
        e = self.experts
        out = self._experts(x, e.gate_up_proj, e.down_proj, weights, ids, e.gate_up_scale,
                            e.down_scale)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + self.shared_expert(x, self.shared_expert_gate(x))
        return all_reduce_(out) if self.reduce else out
