"""Triton grouped GEMMs for a mixture-of-experts MLP: every (token, picked expert) pair's rows
multiplied by its own expert's weights, in one launch per projection.

A step's T tokens each pick k experts: N = T·k pairs. `align_pairs` sorts the pairs by expert
and pads each expert's run to a multiple of the row tile (BLOCK_M), so every row tile belongs to
one expert; `moe_gemm` then runs an ordinary tiled GEMM per row tile against that expert's
weight, its A rows gathered by pair and its C rows scattered back to pair order. Two such
GEMMs with SiLU-and-mul between them, and a sum over each token's k rows, make the layer
(`engine/model/moe.py`). No more pairs than experts (batch-1 and small decode batches) skip the
sort: each pair is its own row tile (`per_pair_layout`), every tile then has one live row, and
the kernel is a GEMV reading each picked expert's weights once per pair (about once each, as few
pairs share an expert).

Routing (softmax, top-k, renormalisation) is one kernel per step (`route_topk`). Nothing here
reads tensor data on the host: the sort (one Triton program for small steps, torch ops for
large ones), the padding and the tile-to-expert map are device ops of fixed shapes (sized for the worst case, N + E·(BLOCK_M − 1) rows), and tiles
past the padded total exit at once. So a decode step with MoE layers captures in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._attention_tile import dot_precision, upcast_dots
from engine.kernels._checks import FLOAT_DTYPES, KernelInputError, check_devices, check_tensor
from engine.kernels._tl import cumsum, reduce_max, reduce_min, reduce_sum

# At most this many pairs (and no more than experts) run one pair per row tile, unsorted;
# more are sorted by expert. In a decode graph on the H200 one-pair tiles took Qwen3-30B-A3B's
# layer at 4 tokens (32 pairs) in 0.095 ms where sorting them took 0.135 (moe_check at
# d293832 vs ca776e8), and batch 8 (64 pairs) decoded in 10.2 ms vs 10.7.
PER_PAIR_MAX = 64
# One program sorts a step's pairs (`_align_kernel`: one launch where the torch ops take ~25)
# while pairs x max(expert bins, 64) stays within this; more sort with the torch ops, whose
# time hardly grows with the pairs. In CUDA graphs on the H200 (gpu_moe_check.py --align,
# bench/results/h200/moe_0bc3eee/): 128 experts, 1,024 pairs 0.067 vs 0.087 ms, 3,072 pairs
# 0.164 vs 0.089; 8 experts, 3,072 pairs 0.071 vs 0.087, 8,192 pairs 0.179 vs 0.127.
ALIGN_KERNEL_WORK = 1 << 18


@dataclass(frozen=True, slots=True)
class PairLayout:
    """Row tiles of a grouped GEMM: `sorted_pairs[i]` the pair in row i (N: padding),
    `tile_expert[j]` the expert of row tile j, `rows_used` [1] how many rows carry tiles
    (padding included); BLOCK_M rows per tile."""

    sorted_pairs: torch.Tensor  # [R] int32
    tile_expert: torch.Tensor   # [R / BLOCK_M] int32 or int64
    rows_used: torch.Tensor     # [1] int32
    block_m: int
    num_pairs: int
    per_pair: bool = False


def per_pair_layout(topk_ids: torch.Tensor) -> PairLayout:
    """One row tile per pair, 16 rows of which the first is the pair: no sort, and no kernel —
    the rows depend only on the pair count (cached per count and device) and the tiles' experts
    are the picks themselves. For few pairs, where a sorted layout's launches cost more than
    reading an expert's weights once per pair that picked it."""
    n = topk_ids.numel()
    rows, used = _per_pair_rows(n, topk_ids.device)
    return PairLayout(rows, topk_ids.reshape(-1), used, _PER_PAIR_BLOCK_M, n, per_pair=True)


_PER_PAIR_BLOCK_M = 16
_PER_PAIR_ROWS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _per_pair_rows(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, rows_used) of `n` pairs one per tile. Cached outside CUDA-graph capture
    only: a tensor made during capture belongs to that graph's memory pool."""
    key = (n, device)
    cached = _PER_PAIR_ROWS.get(key)
    if cached is not None:
        return cached
    rows = torch.full((n, _PER_PAIR_BLOCK_M), n, dtype=torch.int32, device=device)
    rows[:, 0] = torch.arange(n, dtype=torch.int32, device=device)
    used = torch.full((1,), n * _PER_PAIR_BLOCK_M, dtype=torch.int32, device=device)
    made = (rows.view(-1), used)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _PER_PAIR_ROWS[key] = made
    return made


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                use_kernel: bool | None = None) -> PairLayout:
    """Pairs sorted by expert (stably: a pair's rank among its expert's follows pair order),
    each expert's run padded to a multiple of `block_m` rows. topk_ids: [T, k] expert of each
    pair (pair p = token p // k, pick p % k). `use_kernel`: sort in one Triton program (the
    default for the steps where it is faster: ALIGN_KERNEL_WORK) or with torch ops."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    capacity = n + num_experts * (block_m - 1)
    capacity = -(-capacity // block_m) * block_m
    if use_kernel is None:
        bins = triton.next_power_of_2(num_experts + 1)
        use_kernel = num_experts <= 1024 and n * max(bins, 64) <= ALIGN_KERNEL_WORK
    if use_kernel:
        return _align_with_kernel(flat, num_experts, block_m, capacity)
    flat = flat.to(torch.int64)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in sorted order
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = padded_start[expert_of] + torch.arange(n, device=dev) - first[expert_of]
    sorted_pairs = torch.full((capacity,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(0, capacity, block_m, device=dev)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = tile_expert.clamp_(max=num_experts - 1).to(torch.int32)
    used = padded_end[-1:].to(torch.int32)
    return PairLayout(sorted_pairs, tile_expert, used, block_m, n)


def _align_with_kernel(flat: torch.Tensor, num_experts: int, block_m: int, capacity: int
                       ) -> PairLayout:
    if num_experts > 1024:
        raise KernelInputError(f"{num_experts} experts: the sorting kernel takes at most 1024")
    dev = flat.device
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    n = flat.numel()
    block_e = triton.next_power_of_2(num_experts + 1)  # bin num_experts: masked-off lanes
    chunk = 64 if block_e <= 256 else 16
    _align_kernel[(1,)](flat, sorted_pairs, tile_expert, used, n, num_experts, capacity,
                        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, num_warps=4)
    return PairLayout(sorted_pairs, tile_expert, used, block_m, n)


@triton.jit
def _align_kernel(
    ids_ptr,  # [N] expert of each pair (any integer type)
    sorted_pairs_ptr,  # [capacity] int32 out
    tile_expert_ptr,  # [capacity / BLOCK_M] int32 out
    rows_used_ptr,  # [1] int32 out
    num_pairs,
    num_experts,
    capacity,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`align_pairs` in one program: count each expert's pairs, pad, lay the tiles out, then
    place every pair at its expert's start plus its rank among that expert's earlier pairs
    (counted in registers, chunk by chunk: stable, no atomics)."""
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.full([BLOCK_E], 0, tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E)
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = cumsum(padded, 0)
    starts = ends - padded
    tl.store(rows_used_ptr, reduce_sum(padded, 0))
    # Tile j belongs to the expert whose padded run covers row j * BLOCK_M: the number of
    # experts whose runs end at or before it.
    num_tiles = capacity // BLOCK_M
    for t0 in range(0, num_tiles, CHUNK):
        tiles = t0 + lanes
        before = (ends[None, :] <= (tiles * BLOCK_M)[:, None]) & (experts[None, :] < num_experts)
        owner = tl.minimum(reduce_sum(before.to(tl.int32), 1), num_experts - 1)
        tl.store(tile_expert_ptr + tiles, owner, mask=tiles < num_tiles)
    for r0 in range(0, capacity, CHUNK):
        rows = r0 + lanes
        tl.store(sorted_pairs_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_pairs,
                 mask=rows < capacity)
    tl.debug_barrier()  # the padding is written before any pair's row
    cursor = starts
    for start in range(0, num_pairs, CHUNK):
        offs = start + lanes
        live = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=live, other=num_experts).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        base = reduce_sum(onehot * cursor[None, :], 1)
        # rank among this chunk's earlier pairs of the same expert
        same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = reduce_sum(same.to(tl.int32), 1)
        tl.store(sorted_pairs_ptr + base + rank, offs, mask=live)
        cursor += reduce_sum(onehot, 0)


@dataclass(frozen=True, slots=True)
class MoETile:
    """A grouped GEMM's tiles and launch shape (BLOCK_M is the layout's)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def layout_for(topk_ids: torch.Tensor, num_experts: int, block_m: int | None = None
               ) -> PairLayout:
    """The layout `moe_gemm` runs a step's pairs in: one pair per tile while there are no more
    pairs than experts (each expert's weights then read about once), else sorted by expert with
    a row tile that grows with the pairs per expert (`block_m` forces one: sweeps)."""
    n = topk_ids.numel()
    if block_m is None and n <= min(PER_PAIR_MAX, num_experts):
        return per_pair_layout(topk_ids)
    if block_m is None:
        per_expert = n / num_experts
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64 \
            if per_expert < 128 else 128
    return align_pairs(topk_ids, num_experts, block_m)


def tile_for(layout: PairLayout, n_out: int, k_in: int) -> MoETile:
    """Tiles for a layout's row tile and a GEMM's [n_out, k_in] experts, from the H200 sweep
    (bench/results/h200/moe_*/moe_sweep.json: Qwen3-30B-A3B's and Mixtral-8x7B's layers, 1 to
    8,192 tokens): deep K tiles for the few-row tiles that stream weights, 256-wide N tiles for
    the large row tiles of prefill."""
    del n_out, k_in  # the sweep found one table good for both GEMMs of both shapes
    if layout.block_m <= 32:
        return MoETile(64, 128, 4, 3)
    if layout.block_m <= 64:
        return MoETile(128, 64, 8, 3)
    return MoETile(256, 64, 8, 3)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [A rows, K]: rows are tokens (GATHER_TOKENS) or pairs
    w_ptr,  # [E, N, K]
    c_ptr,  # [pairs, N]
    sorted_pairs_ptr,  # [R] int32
    tile_expert_ptr,  # [R / BLOCK_M] int32
    rows_used_ptr,  # [1] int32
    weight_ptr,  # [pairs] float32 routing weights (MUL_WEIGHT)
    scale_ptr,  # [E, N] float32 per-channel scales of int8 weights (HAS_SCALE)
    num_pairs,
    n_out,
    k_in,
    top_k,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    GATHER_TOKENS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(rows_used_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)
    live = pair < num_pairs
    row = pair // top_k if GATHER_TOKENS else pair
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    w_ptrs = (w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
              + offs_k[:, None])
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)  # tl.zeros: see engine/kernels/_tl.py
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < n_out), other=0)
        if HAS_SCALE:  # int8 weights: exact in the activations' type (|q| <= 127)
            w = w.to(a.dtype)
        if UPCAST_DOT:  # the interpreter's bf16 dot is wrong (engine/kernels/_attention_tile.py)
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        scale = tl.load(scale_ptr + expert * n_out + offs_n, mask=offs_n < n_out, other=0.0)
        acc = acc * scale[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=live, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=live[:, None] & (offs_n[None, :] < n_out))


def moe_gemm(a: torch.Tensor, weights: torch.Tensor, layout: PairLayout, top_k: int,
             gather_tokens: bool, routing_weights: torch.Tensor | None = None,
             tile: MoETile | None = None, weight_scale: torch.Tensor | None = None
             ) -> torch.Tensor:
    """C [pairs, N]: row p = a[row of p] @ weights[expert of p].T, times routing_weights[p] when
    given. a: [T, K] token rows (`gather_tokens`: pair p reads row p // top_k) or [pairs, K];
    weights: [E, N, K] (each expert's `nn.Linear` weight), in a's dtype or int8 with
    `weight_scale` [E, N] float32 (W8A16: each output channel times its scale);
    routing_weights: [pairs] float32."""
    a = check_tensor("a", a, 2, FLOAT_DTYPES)
    weights = check_tensor("weights", weights, 3,
                           (torch.int8,) if weight_scale is not None else FLOAT_DTYPES)
    num_experts, n_out, k_in = weights.shape
    if a.shape[1] != k_in:
        raise KernelInputError(f"a has {a.shape[1]} columns, the experts take {k_in}")
    if weight_scale is None and a.dtype != weights.dtype:
        raise KernelInputError(f"a is {a.dtype}, weights {weights.dtype}")
    if weight_scale is not None and (weight_scale.dtype != torch.float32
                                     or tuple(weight_scale.shape) != (num_experts, n_out)
                                     or not weight_scale.is_contiguous()):
        raise KernelInputError(f"weight_scale must be contiguous float32 [{num_experts}, "
                               f"{n_out}], got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if a.stride(1) != 1 or weights.stride(2) != 1:
        raise KernelInputError("a and weights must be dense in their last dimension")
    rows = layout.num_pairs // top_k if gather_tokens else layout.num_pairs
    if a.shape[0] != rows:
        raise KernelInputError(f"a has {a.shape[0]} rows, the layout's {layout.num_pairs} "
                               f"pairs need {rows}")
    check_devices(("a", "weights", "weight_scale"),
                  (a, weights, weight_scale if weight_scale is not None else weights))
    out = torch.empty((layout.num_pairs, n_out), dtype=a.dtype, device=a.device)
    if layout.num_pairs == 0:
        return out
    if routing_weights is not None and (routing_weights.dtype != torch.float32
                                        or routing_weights.numel() != layout.num_pairs):
        raise KernelInputError("routing_weights must be float32, one per pair")
    tile = tile or tile_for(layout, n_out, k_in)
    block_k = min(tile.block_k, max(16, triton.next_power_of_2(k_in)))
    grid = (layout.sorted_pairs.numel() // layout.block_m, triton.cdiv(n_out, tile.block_n))
    _moe_gemm_kernel[grid](
        a, weights, out, layout.sorted_pairs, layout.tile_expert, layout.rows_used,
        routing_weights if routing_weights is not None else out,
        weight_scale if weight_scale is not None else out,
        layout.num_pairs, n_out, k_in, top_k,
        a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        GATHER_TOKENS=gather_tokens, MUL_WEIGHT=routing_weights is not None,
        HAS_SCALE=weight_scale is not None,
        DOT_PRECISION=dot_precision(a.dtype), UPCAST_DOT=upcast_dots(a.dtype),
        BLOCK_M=layout.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int64
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALISE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    top = reduce_max(x, 0)
    denom = reduce_sum(tl.where(valid, tl.exp(x - top), 0.0), 0)
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.full([BLOCK_K], 0.0, tl.float32)
    picked_id = tl.full([BLOCK_K], 0, tl.int64)
    rest = x
    for j in tl.static_range(TOP_K):  # k rounds of argmax, the lowest index among ties
        best = reduce_max(rest, 0)
        idx = reduce_min(tl.where(rest == best, offs, BLOCK_E), 0)
        picked_w = tl.where(slots == j, tl.exp(best - top) / denom, picked_w)
        picked_id = tl.where(slots == j, idx.to(tl.int64), picked_id)
        rest = tl.where(offs == idx, float("-inf"), rest)
    if RENORMALISE:
        picked_w = picked_w / reduce_sum(picked_w, 0)
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, picked_w, mask=slots < TOP_K)
    tl.store(ids_ptr + out, picked_id, mask=slots < TOP_K)


def route_topk(logits: torch.Tensor, top_k: int, renormalise: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.model.moe.route` in one kernel: (weights [T, k] float32, ids [T, k] int64) of
    router logits [T, E] — softmax in float32, the k largest (largest first), renormalised to
    sum to 1 when asked."""
    logits = check_tensor("logits", logits, 2, FLOAT_DTYPES)
    tokens, experts = logits.shape
    if not 0 < top_k <= experts or experts > 1024:
        raise KernelInputError(f"top_k {top_k} of {experts} experts (at most 1024)")
    if logits.stride(1) != 1:
        raise KernelInputError("logits must be dense in their last dimension")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
            RENORMALISE=renormalise, BLOCK_E=max(16, triton.next_power_of_2(experts)),
            BLOCK_K=max(2, triton.next_power_of_2(top_k)), num_warps=4 if experts > 256 else 1)
    return weights, ids
