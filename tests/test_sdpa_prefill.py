"""Long prompts with nothing cached go through torch SDPA in the Triton backend; everything else
stays on the paged Triton kernel (TRITON_INTERPRET=1, CPU: SDPA runs its math backend here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from conftest import tiny_llm
from test_kernels import _interpret, assert_close_for  # noqa: F401

from engine.attention import sdpa_prefill, triton_backend
from engine.attention.forward_context import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledToken

H, HKV, D, BS = 4, 2, 16, 16
LONG = sdpa_prefill.MIN_FRESH_PREFILL_TOKENS


def _step(q_lens: list[int], ctx_lens: list[int], seed: int
          ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill-only step: sequence i has ctx_lens[i] cached tokens and q_lens[i] new ones, in
    shuffled blocks of a cache that holds random (wrong) values everywhere else."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    per_seq = [-(-s // BS) for s in seq_lens]
    perm = torch.randperm(sum(per_seq) + 2, generator=gen)
    tables, slots, start = [], [], 0
    width = max(per_seq)
    for i, nblk in enumerate(per_seq):
        blocks = perm[start:start + nblk]
        start += nblk
        tables.append(torch.cat([blocks, blocks.new_zeros(width - nblk)]))
        pos = torch.arange(ctx_lens[i], seq_lens[i])
        slots.append(blocks[pos // BS] * BS + pos % BS)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.stack(tables).to(torch.int32), slot_mapping=torch.cat(slots),
        num_decodes=0, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        fresh_prefill_len=min(q_lens) if not any(ctx_lens) else 0)  # as the runner sets it
    t = qsl[-1]
    q, k, v = (torch.randn(t, n, D, generator=gen) for n in (H, HKV, HKV))
    cache = torch.randn(2, len(perm), BS, HKV, D, generator=gen)
    return md, q, k, v, cache


def _count_sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = triton_backend.sdpa_fresh_prefill

    def spy(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "sdpa_fresh_prefill", spy)
    return calls


def test_fresh_long_prompts_use_sdpa_and_match_the_torch_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_sdpa_calls(monkeypatch)
    md, q, k, v, cache = _step([LONG + 9, LONG], [0, 0], seed=1)
    cache_ref = cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, cache_ref, md, 0.3)
    got = TritonAttentionBackend().forward(q, k, v, cache, md, 0.3)
    assert calls == [LONG + 9, LONG]
    assert torch.equal(cache, cache_ref)  # the K/V still land in the cache for later decodes
    assert_close_for(got, want, torch.float32)


def test_one_fresh_long_prompt_returns_sdpa_output_directly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The TTFT case: a step of one fresh prompt takes SDPA's output as the layer's (no copy
    into a separate buffer when SDPA's layout is already [T, H, D])."""
    calls = _count_sdpa_calls(monkeypatch)
    md, q, k, v, cache = _step([LONG + 3], [0], seed=4)
    cache_ref = cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, cache_ref, md, 0.3)
    got = TritonAttentionBackend().forward(q, k, v, cache, md, 0.3)
    assert calls == [LONG + 3]
    assert got.shape == (LONG + 3, H, D) and got.is_contiguous()
    assert torch.equal(cache, cache_ref)
    assert_close_for(got, want, torch.float32)


def test_short_prompts_stay_on_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_sdpa_calls(monkeypatch)
    md, q, k, v, cache = _step([20, 9], [0, 0], seed=2)  # fresh, but under the threshold
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), md, 0.3)
    got = TritonAttentionBackend().forward(q, k, v, cache, md, 0.3)
    assert calls == []
    assert_close_for(got, want, torch.float32)


def test_runner_marks_steps_whose_prefills_have_no_cached_context(
        tiny_model_dirs: dict[str, Path]) -> None:
    """`fresh_prefill_len` (what the backend decides on, once per step): the shortest prefill
    when none has KV cached before the step; 0 for a prefix hit, a later chunk, or decodes."""
    eng = tiny_llm(tiny_model_dirs["llama"], max_num_batched_tokens=64).engine

    def step() -> int:  # schedule + prepare one step; sample token 1 for every sampling row
        out = eng.scheduler.schedule()
        fresh = eng.runner.prepare(out)[2].fresh_prefill_len
        eng.scheduler.update_from_output(out, {s.request.request_id: SampledToken(1)
                                               for s in out.scheduled if s.sample})
        return fresh

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = [(5 * j) % 200 + 1 for j in range(40)]
    eng.add_request("a", prompt, params)
    eng.add_request("b", list(range(1, 22)), params)
    assert [step(), step()] == [21, 0]  # two fresh prompts, then their decodes
    eng.add_request("c", prompt, params)
    assert [step(), step()] == [0, 0]  # a's blocks are a prefix hit for c
    eng.add_request("d", list(range(3, 103)), params)
    assert [step(), step()] == [64, 0]  # chunked: the first chunk is fresh, the second is not
    eng.scheduler.check_integrity()


def test_switch_off_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_FRESH_PREFILL", "triton")
    assert not TritonAttentionBackend()._fresh_prefill_sdpa
    monkeypatch.setenv("SPLITSERVE_FRESH_PREFILL", "flash")
    with pytest.raises(ValueError, match="sdpa or triton"):
        sdpa_prefill.fresh_prefill_enabled()
    monkeypatch.delenv("SPLITSERVE_FRESH_PREFILL")
    assert TritonAttentionBackend()._fresh_prefill_sdpa
