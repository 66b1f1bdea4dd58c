"""Long prompts with nothing cached go through torch SDPA in the Triton backend; everything else
stays on the paged Triton kernel (TRITON_INTERPRET=1, CPU: SDPA runs its math backend here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import sdpa_prefill, triton_backend
from engine.attention.forward_context import AttentionMetadata
from engine.attention.kv_quant import quantize_fp8
from engine.attention.prefill_plan import plan_prefill
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.scheduler import SampledToken
from engine_api.sampling_params import SamplingParams
from tests.kernels.test_kernels import _interpret, assert_close_for  # noqa: F401

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from tests.support.engine_driver import tiny_llm

H, HKV, D, BS = 4, 2, 16, 16
LONG = sdpa_prefill.MIN_FRESH_PREFILL_TOKENS


def _step(q_lens: list[int], ctx_lens: list[int], seed: int
          ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step: sequence i has ctx_lens[i] cached tokens and q_lens[i] new ones (leading q_len 1:
    decodes), in shuffled blocks of a cache that holds random (wrong) values everywhere else."""
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
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
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


def test_mixed_step_sends_each_fresh_long_prompt_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline run's prefill step: decodes, a later chunk of a chunked prompt, fresh long
    prompts and a fresh short one. Only the fresh long prompts take SDPA, one call each; the
    others go through the paged kernel, and every row matches the torch backend."""
    calls = _count_sdpa_calls(monkeypatch)
    md, q, k, v, cache = _step([1, 1, 30, LONG + 9, 20, LONG], [50, 7, 40, 0, 0, 0], seed=5)
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), md, 0.3)
    got = TritonAttentionBackend().forward(q, k, v, cache, md, 0.3)
    assert calls == [LONG + 9, LONG]
    assert [(r.first, r.last, r.sdpa) for r in md.prefill_plan or ()] == [
        (2, 3, False), (3, 4, True), (4, 5, False), (5, 6, True)]
    assert_close_for(got, want, torch.float32)


@pytest.mark.parametrize(("window", "softcap", "sdpa_calls"),
                         [(49, 0.0, [49, 40]),  # the window hides nothing of either prompt
                          (40, 0.0, [40]),  # hides the first position from the 49's last token
                          (13, 0.0, []), (0, 5.0, [])])
def test_layers_sdpa_cannot_express_send_fresh_prompts_to_the_paged_kernel(
        monkeypatch: pytest.MonkeyPatch, window: int, softcap: float,
        sdpa_calls: list[int]) -> None:
    """Causal SDPA has no sliding window or soft cap: a fresh prompt longer than the layer's
    window, or any in a capped layer, attends through the paged kernel (its K/V are already in
    the cache); decodes beside it take the window and the cap too. (Prompts of 40 tokens take
    SDPA here, to keep the interpreter's work small.)"""
    monkeypatch.setattr(triton_backend, "MIN_FRESH_PREFILL_TOKENS", 40)
    calls = _count_sdpa_calls(monkeypatch)
    md, q, k, v, cache = _step([1, 49, 40], [60, 0, 0], seed=9)
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), md, 0.3,
                                           sliding_window=window, logit_softcap=softcap)
    got = TritonAttentionBackend().forward(q, k, v, cache, md, 0.3, sliding_window=window,
                                           logit_softcap=softcap)
    assert calls == sdpa_calls
    assert_close_for(got, want, torch.float32)
    if window < 40 or softcap:  # the layer's attention differs from plain causal attention
        plain = TorchAttentionBackend().forward(q, k, v, cache.clone(), md, 0.3)
        assert not torch.allclose(plain, want, atol=1e-4)


def test_plan_groups_consecutive_paged_sequences_into_one_run() -> None:
    md = _step([1, 40, 30, LONG, 9, 12], [5, 16, 0, 0, 3, 0], seed=6)[0]
    runs = plan_prefill(md, LONG)
    assert [(r.first, r.last, r.token_start, r.token_end, r.max_query_len, r.sdpa)
            for r in runs] == [(1, 3, 1, 71, 40, False), (3, 4, 71, 71 + LONG, LONG, True),
                               (4, 6, 71 + LONG, 92 + LONG, 12, False)]
    assert runs[0].query_start_loc.tolist() == [0, 40, 70]
    assert runs[1].query_start_loc.tolist() == [0, LONG]  # an SDPA run has them too
    assert runs[2].query_start_loc.tolist() == [0, 9, 21]
    assert all(not r.sdpa for r in plan_prefill(md, None))  # SDPA off: every prefill paged


def test_plan_from_the_runner_follows_cached_context(tiny_model_dirs: dict[str, Path]) -> None:
    """The runner's host offsets tell fresh prompts (seq_len == q_len) from prefix-cache hits and
    later chunks, which must stay paged."""
    eng = tiny_llm(tiny_model_dirs["llama"], max_num_batched_tokens=64).engine

    def step() -> list[bool]:  # schedule + prepare one step; sample token 1 for every sampling row
        out = eng.scheduler.schedule()
        runs = plan_prefill(eng.runner.prepare(out)[2], 2)
        eng.scheduler.update_from_output(out, {s.request.request_id: SampledToken(1)
                                               for s in out.scheduled if s.sample})
        return [r.sdpa for r in runs]

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = [(5 * j) % 200 + 1 for j in range(40)]
    eng.add_request("a", prompt, params)
    eng.add_request("b", list(range(1, 22)), params)
    assert [step(), step()] == [[True, True], []]  # two fresh prompts, then their decodes
    eng.add_request("c", prompt, params)
    assert [step(), step()] == [[False], []]  # a's blocks are a prefix hit for c
    eng.add_request("d", list(range(3, 103)), params)
    assert [step(), step()] == [[True], [False]]  # chunked: the first chunk is fresh only
    eng.scheduler.check_integrity()


def test_fp8_cache_fresh_long_prompt_attends_to_its_exact_kv(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With an fp8 cache a fresh long prompt still takes SDPA, on its unquantized K/V (as
    SGLang's ragged prefill does), while the K/V land quantized in the cache and the step's
    decode reads them from there."""
    calls = _count_sdpa_calls(monkeypatch)
    md, q, k, v, exact = _step([1, LONG + 2], [9, 0], seed=7)
    fp8 = quantize_fp8(exact, 0.5)
    fp8_ref = fp8.clone()
    got = TritonAttentionBackend().forward(q, k, v, fp8, md, 0.3, (0.5, 0.5))
    assert calls == [LONG + 2]
    want_fp8 = TorchAttentionBackend().forward(q, k, v, fp8_ref, md, 0.3, (0.5, 0.5))
    assert torch.equal(fp8.view(torch.uint8), fp8_ref.view(torch.uint8))  # same quantized writes
    want_exact = TorchAttentionBackend().forward(q, k, v, exact, md, 0.3)
    assert_close_for(got[1:], want_exact[1:], torch.float32)  # the prompt: exact K/V
    assert_close_for(got[:1], want_fp8[:1], torch.float32)  # the decode: the fp8 cache


def test_switch_off_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_FRESH_PREFILL", "triton")
    assert not TritonAttentionBackend()._fresh_prefill_sdpa
    monkeypatch.setenv("SPLITSERVE_FRESH_PREFILL", "flash")
    with pytest.raises(ValueError, match="sdpa or triton"):
        sdpa_prefill.fresh_prefill_enabled()
    monkeypatch.delenv("SPLITSERVE_FRESH_PREFILL")
    assert TritonAttentionBackend()._fresh_prefill_sdpa
