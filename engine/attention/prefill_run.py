"""`PrefillRun`: one run of a step's prefill sequences and the kernel it attends with.

Its own module so that the attention metadata (engine/attention/forward_context.py), which
carries a step's plan, and the planner (engine/attention/prefill_plan.py), which reads the
metadata, both import it downward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillRun:
    """Prefill sequences [first, last) of a step, tokens [token_start, token_end)."""

    first: int
    last: int
    token_start: int
    token_end: int
    max_query_len: int
    # A fresh long prompt (then first + 1 == last) through SDPA; else a run of the paged kernel.
    sdpa: bool
    # The run's query offsets relative to token_start, [last - first + 1] int32 on the device
    # (made once per step, not once per layer). SDPA runs have them too: a layer whose
    # attention SDPA cannot express (a sliding window shorter than the prompt, soft-capped
    # scores) sends its fresh prompt to the paged kernel.
    query_start_loc: torch.Tensor
