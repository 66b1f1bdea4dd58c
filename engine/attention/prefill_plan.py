"""How a step's prefill sequences attend: vendor SDPA per fresh long prompt, the paged kernel for
the rest (the Triton backend's per-step decision, made once at the first layer).

A prompt with nothing cached before this step (`seq_len == q_len`) attends only to its own fresh
K/V, so torch SDPA (cuDNN / FlashAttention on Hopper) can take it without a block table. Every
other prefill (a later chunk of a chunked prompt, a prefix-cache hit, a short prompt) stays on
the paged Triton kernel. The decision is per sequence: an offline run's prefill steps mix one
continuing chunk with several fresh prompts, and deciding for the whole step sent all of them
through the paged kernel. Where that matters is long prompts (a 4096-token prompt: TTFT 100.6 ms
through cuDNN, 103.2 through the paged kernel); for the 1000-token prompts of `random 1000x1000`
the two measured the same (bench/results/h200/probe_tput_bf16_*d18ba9a.json).

Consecutive paged sequences form one run, so a step costs one paged launch per run plus one
SDPA call per fresh long prompt.
"""

from __future__ import annotations

from engine.attention.forward_context import AttentionMetadata
from engine.attention.prefill_run import PrefillRun


def plan_prefill(md: AttentionMetadata, sdpa_min_tokens: int | None) -> tuple[PrefillRun, ...]:
    """Split the prefill sequences (those after the `num_decodes` leading decodes) into runs.

    sdpa_min_tokens: fresh prompts of at least this many tokens go through SDPA; None sends
    every prefill to the paged kernel. Reads the host copies of the offsets only: no syncs."""
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    num_seqs = len(seq_lens)
    runs: list[PrefillRun] = []
    paged_from = -1  # first sequence of the open paged run, or -1

    def run(first: int, last: int, sdpa: bool) -> PrefillRun:
        a, b = qsl[first], qsl[last]
        offsets = md.query_start_loc[first:last + 1]
        return PrefillRun(first, last, a, b, max(qsl[i + 1] - qsl[i] for i in range(first, last)),
                          sdpa, offsets - a if a else offsets)

    for i in range(md.num_decodes, num_seqs):
        q_len = qsl[i + 1] - qsl[i]
        if sdpa_min_tokens is not None and q_len >= sdpa_min_tokens and seq_lens[i] == q_len:
            if paged_from >= 0:
                runs.append(run(paged_from, i, False))
                paged_from = -1
            runs.append(run(i, i + 1, True))
        elif paged_from < 0:
            paged_from = i
    if paged_from >= 0:
        runs.append(run(paged_from, num_seqs, False))
    return tuple(runs)
