"""Triton scoring of logits rows against target tokens, in one pass over each row: what prompt
logprobs need of the LM head's output (engine/prompt_logprobs.py).

Per row, from the raw logits (bf16, fp16 or fp32; math in fp32): the target token's logprob,
its 1-based rank (how many logits exceed the target's, plus one), the log-sum-exp (online, as
flash attention keeps its softmax; any logit's logprob is it minus this) and the row's argmax
(the first of equal maxima, as `torch.max` picks). The torch path made a float32 copy of each slice's logits, a
log-softmax of it, a comparison tensor and its sum: four passes over 512 x 128k floats and
two of them written (bench/results/h200/prompt_logprobs/: ~0.8 ms a slice on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_devices,
    check_inner_dense,
    check_tensor,
    next_power_of_2,
)
from engine.kernels._tl import reduce_max, reduce_min, reduce_sum

_MAX_BLOCK = 4096


@triton.jit
def _score_rows_kernel(
    logits_ptr,  # [R, V], rows `stride_row` apart, dense within a row
    targets_ptr,  # [R] int64
    lp_ptr,  # [R] float32: the target's logprob
    rank_ptr,  # [R] int64
    lse_ptr,  # [R] float32: log-sum-exp of the row
    top_id_ptr,  # [R] int64: its argmax
    stride_row,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    t_logit = tl.load(base + target).to(tl.float32)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.full([], 0.0, tl.float32)
    above = tl.full([], 0, tl.int64)
    best_id = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        blk_max = reduce_max(x, 0)
        # The block's first maximum (tl.argmax is a @jit helper the interpreter may refuse:
        # engine/kernels/_tl.py).
        blk_arg = reduce_min(tl.where(x == blk_max, offs.to(tl.int64), vocab), 0)
        new_max = tl.maximum(run_max, blk_max)
        run_sum = run_sum * tl.exp(run_max - new_max) + reduce_sum(tl.exp(x - new_max), 0)
        best_id = tl.where(blk_max > run_max, blk_arg, best_id)  # strict: the first max wins
        run_max = new_max
        above += reduce_sum((x > t_logit).to(tl.int64), 0)
    lse = run_max + tl.log(run_sum)
    tl.store(lp_ptr + row, t_logit - lse)
    tl.store(rank_ptr + row, above + 1)
    tl.store(lse_ptr + row, lse)
    tl.store(top_id_ptr + row, best_id)


def score_rows(logits: torch.Tensor, targets: torch.Tensor, block: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logprob [R] fp32, rank [R] int64, log-sum-exp [R] fp32, argmax [R] int64) of
    `logits [R, V]` (dense in its last dim) against `targets [R]` (int64 ids < V).
    `block`: vocabulary entries a program reads at a time (default: up to 4096)."""
    logits = check_tensor("logits", logits, 2, FLOAT_DTYPES)
    targets = check_tensor("targets", targets, 1, (torch.int64,))
    check_inner_dense("logits", logits, 1)
    check_devices(("logits", "targets"), (logits, targets))
    rows, vocab = logits.shape
    if targets.shape[0] != rows:
        raise KernelInputError(f"targets must have {rows} entries (one per row), got "
                               f"{targets.shape[0]}")
    if vocab == 0:
        raise KernelInputError("logits must have at least one column")
    block = block or min(_MAX_BLOCK, next_power_of_2(vocab))
    if block & (block - 1):
        raise KernelInputError(f"block must be a power of two, got {block}")
    dev = logits.device
    lp = torch.empty(rows, dtype=torch.float32, device=dev)
    rank = torch.empty(rows, dtype=torch.int64, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    top_id = torch.empty(rows, dtype=torch.int64, device=dev)
    if rows:
        _score_rows_kernel[(rows,)](logits, targets, lp, rank, lse, top_id, logits.stride(0),
                                    vocab, BLOCK=block, num_warps=8)
    return lp, rank, lse, top_id
