"""The fused RoPE + KV-write kernel (TRITON_INTERPRET=1, CPU) against the torch references, and the
Triton attention backend that uses it against the torch backend.

References: `rotary_embedding_ref` then `write_kv_ref` (engine/kernels/reference.py). Inputs are
views of one fused QKV row per token (a padded token stride), with GQA, slot -1 padding tokens,
repeated positions, and fp8 caches whose scales saturate some values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.forward_context import AttentionMetadata, RopeInputs
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from tests.kernels.test_kernels import (  # noqa: F401
    K,
    KernelInputError,
    R,
    _fp8_scales,
    _interpret,
    assert_close_for,
)
from tests.support.engine_driver import Trace, greedy, run_to_end, tiny_llm

FP8 = torch.float8_e4m3fn
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
NUM_BLOCKS, BLOCK_SIZE = 6, 4
MAX_POS = 64


def _split(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v views of a fused QKV output `[T, (H + 2Hkv) * D]` (token stride (H + 2Hkv) * D)."""
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM],
                        dim=-1)
    num_tokens = qkv.shape[0]
    return (q.view(num_tokens, NUM_HEADS, HEAD_DIM), k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM))


def _qkv(num_tokens: int, dtype: torch.dtype, gen: torch.Generator
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv, q, k, v) with q/k/v views of a random fused QKV output."""
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = (torch.randn(num_tokens, width, generator=gen) * 4).to(dtype)
    return (qkv, *_split(qkv))


def _cos_sin(gen: torch.Generator) -> torch.Tensor:
    """A real RoPE table [MAX_POS, D] float32 (cos | sin), as RotaryEmbedding builds it."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _inputs(num_tokens: int, dtype: torch.dtype, pos_dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor, torch.Tensor]:
    """(positions, qkv, q, k, v, cos_sin_cache, slot_mapping); every 4th token is padding."""
    gen = torch.Generator().manual_seed(seed)
    qkv, q, k, v = _qkv(num_tokens, dtype, gen)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, dtype=pos_dtype)
    positions[1] = positions[0]  # two tokens at one position
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slot_mapping[3::4] = -1
    return positions, qkv, q, k, v, _cos_sin(gen), slot_mapping


def _reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
               k_scale: object, v_scale: object, is_neox: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated (q, k) and the written cache from the torch references, on copies."""
    q_ref, k_ref, cache_ref = q.clone(), k.clone(), kv_cache.clone()
    R.rotary_embedding_ref(positions, q_ref, k_ref, cos_sin, is_neox=is_neox)
    R.write_kv_ref(k_ref, v, cache_ref, slot_mapping, k_scale, v_scale)  # type: ignore[arg-type]
    return q_ref, k_ref, cache_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_matches_rotary_then_write_kv_reference(dtype: torch.dtype, is_neox: bool,
                                                pos_dtype: torch.dtype) -> None:
    positions, _, q, k, v, cos_sin, slot_mapping = _inputs(9, dtype, pos_dtype, seed=1)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    before, v_before = kv_cache.clone(), v.clone()
    q_ref, k_ref, cache_ref = _reference(positions, q, k, v, cos_sin, kv_cache, slot_mapping,
                                         None, None, is_neox)
    K.rotary_and_write_kv(positions, q, k, v, cos_sin, kv_cache, slot_mapping, is_neox=is_neox)
    assert_close_for(q, q_ref, dtype)
    assert_close_for(k, k_ref, dtype)
    assert_close_for(kv_cache, cache_ref, dtype)
    assert torch.equal(v, v_before), "v must be untouched"
    # Independently of the references: each written slot holds exactly the token's rotated k
    # (as left in k) and its v; padding tokens and all other slots leave the cache as it was.
    flat, flat_before = kv_cache.flatten(1, 2), before.flatten(1, 2)
    written = {int(s): t for t, s in enumerate(slot_mapping.tolist()) if s >= 0}
    for slot in range(NUM_BLOCKS * BLOCK_SIZE):
        tok = written.get(slot)
        assert torch.equal(flat[0, slot], k[tok] if tok is not None else flat_before[0, slot])
        assert torch.equal(flat[1, slot], v[tok] if tok is not None else flat_before[1, slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["none", "float", "tensor"])
def test_fp8_cache_matches_reference(dtype: torch.dtype, scales: str) -> None:
    """Quantize the rotated k on store: bit-exact against write_kv_ref of the rotated k; with
    k_scale 0.05 (test_kernels' scales: none, floats, one-element tensors) some values saturate."""
    positions, _, q, k, v, cos_sin, slot_mapping = _inputs(9, dtype, torch.int64, seed=2)
    k.mul_(10)  # |k| / 0.05 past 448 for |k| > 22.4: saturates
    k_scale, v_scale = _fp8_scales(scales)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=FP8)
    q_ref, k_ref, cache_ref = _reference(positions, q, k, v, cos_sin, kv_cache, slot_mapping,
                                         k_scale, v_scale, True)
    K.rotary_and_write_kv(positions, q, k, v, cos_sin, kv_cache, slot_mapping,
                          k_scale, v_scale)  # type: ignore[arg-type]
    assert_close_for(q, q_ref, dtype)
    assert_close_for(k, k_ref, dtype)
    want = torch.zeros_like(kv_cache)
    R.write_kv_ref(k, v, want, slot_mapping, k_scale, v_scale)  # type: ignore[arg-type]
    assert torch.equal(kv_cache.view(torch.uint8), want.view(torch.uint8))
    # And within one e4m3 step (2**-3 relative, 2**-9 * scale for subnormals) of the reference
    # built from the reference's rotation (whose bf16 rounding may differ by one ulp).
    got, ref = (R.dequantize_kv_ref(c, k_scale, v_scale)  # type: ignore[arg-type]
                for c in (kv_cache, cache_ref))
    torch.testing.assert_close(got, ref, atol=2**-9, rtol=0.125)
    if scales != "none":
        assert kv_cache[0].float().abs().max() == 448.0


def test_int8_cache_matches_reference() -> None:
    """int8: the rotated k quantized on store (x / scale, saturated at +-127, rounded half away
    from zero), bit-exact against write_kv_ref of the rotated k; some values saturate."""
    positions, _, q, k, v, cos_sin, slot_mapping = _inputs(9, torch.bfloat16, torch.int64, seed=3)
    k.mul_(10)  # |k| / 0.05 past 127 for |k| > 6.35: saturates
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.int8)
    K.rotary_and_write_kv(positions, q, k, v, cos_sin, kv_cache, slot_mapping, 0.05, 0.02)
    want = torch.zeros_like(kv_cache)
    R.write_kv_ref(k, v, want, slot_mapping, 0.05, 0.02)
    assert torch.equal(kv_cache, want)
    assert kv_cache[0].abs().max() == 127 and kv_cache.min() >= -127


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_equals_the_two_unfused_kernels_bitwise(cache_dtype: torch.dtype) -> None:
    """The module's promise: exactly `rotary_embedding` then `write_kv`."""
    positions, qkv, q, k, v, cos_sin, slot_mapping = _inputs(7, torch.bfloat16, torch.int64, 3)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    scales = (0.02, 0.5) if cache_dtype == FP8 else (None, None)
    qkv_two, cache_two = qkv.clone(), kv_cache.clone()
    q2, k2, v2 = _split(qkv_two)
    K.rotary_embedding(positions, q2, k2, cos_sin)
    K.write_kv(k2, v2, cache_two, slot_mapping, *scales)
    K.rotary_and_write_kv(positions, q, k, v, cos_sin, kv_cache, slot_mapping, *scales)
    assert torch.equal(qkv, qkv_two)
    assert torch.equal(kv_cache.view(torch.uint8), cache_two.view(torch.uint8))


def test_no_tokens_is_a_no_op() -> None:
    positions, _, q, k, v, cos_sin, slot_mapping = _inputs(4, torch.float32, torch.int64, 4)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    K.rotary_and_write_kv(positions[:0], q[:0], k[:0], v[:0], cos_sin, kv_cache, slot_mapping[:0])
    assert not kv_cache.any()


def test_rejects_what_either_unfused_kernel_rejects() -> None:
    positions, _, q, k, v, cos_sin, slots = _inputs(4, torch.float32, torch.int64, 5)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    fp8_cache = cache.to(FP8)
    bad: list[tuple[str, tuple[object, ...], dict[str, object]]] = [
        ("positions", (positions.float(), q, k, v, cos_sin, cache, slots), {}),
        ("positions", (positions[:3], q, k, v, cos_sin, cache, slots), {}),
        ("cos_sin_cache", (positions, q, k, v, cos_sin[:, :8], cache, slots), {}),
        ("dense", (positions, torch.randn(4, NUM_HEADS, 2 * HEAD_DIM)[:, :, :HEAD_DIM], k, v,
                   cos_sin, cache, slots), {}),
        ("k has dtype", (positions, q, k.double(), v, cos_sin, cache, slots), {}),
        ("k must be", (positions, q, k[:, :, :8], v, cos_sin, cache, slots), {}),
        ("slot_mapping", (positions, q, k, v, cos_sin, cache, slots.int()), {}),
        ("slot_mapping", (positions, q, k, v, cos_sin, cache, slots[:3]), {}),
        ("value must have shape", (positions, q, k, v[:, :1], cos_sin, cache, slots), {}),
        ("kv_cache", (positions, q, k, v, cos_sin, cache[0], slots), {}),
        ("kv_cache has", (positions, q.half(), k.half(), v.half(), cos_sin, cache, slots), {}),
        ("k_scale is only allowed", (positions, q, k, v, cos_sin, cache, slots),
         {"k_scale": 0.5}),
        ("both be floats", (positions, q, k, v, cos_sin, fp8_cache, slots),
         {"k_scale": 0.5, "v_scale": torch.tensor(0.5)}),
        ("positive", (positions, q, k, v, cos_sin, fp8_cache, slots), {"v_scale": -1.0}),
    ]
    for message, args, kwargs in bad:
        with pytest.raises(KernelInputError, match=message):
            K.rotary_and_write_kv(*args, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- attention backends


def _mixed_step_metadata() -> AttentionMetadata:
    """One decode (position 5 of 6) then a prefill chunk of 5 tokens after a 4-token prefix."""
    bs = BLOCK_SIZE
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32),
        block_tables=torch.tensor([[5, 2, 0], [1, 4, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([2 * bs + 1, 4 * bs + 0, 4 * bs + 1, 4 * bs + 2, 4 * bs + 3,
                                   3 * bs + 0]),
        num_decodes=1, max_query_len=5, max_seq_len=9,
        query_start_loc_cpu=[0, 1, 6], seq_lens_cpu=[6, 9])


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8, torch.int8])
def test_triton_backend_with_rope_matches_torch_backend(cache_dtype: torch.dtype) -> None:
    """Triton rotating q/k itself (rope=) vs the torch backend given the reference rotation."""
    gen = torch.Generator().manual_seed(6)
    md = _mixed_step_metadata()
    _, q, k, v = _qkv(6, torch.float32, gen)
    positions = torch.tensor([5, 4, 5, 6, 7, 8])
    cos_sin = _cos_sin(gen)
    prior = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    quantized = cache_dtype in (FP8, torch.int8)
    kv_scale = (0.05, 0.02) if quantized else (1.0, 1.0)
    cache_triton = (R.quantize_ref(prior, 0.05, cache_dtype) if quantized else prior.clone())
    cache_torch = cache_triton.clone()
    q_ref, k_ref = q.clone(), k.clone()
    R.rotary_embedding_ref(positions, q_ref, k_ref, cos_sin)
    want = TorchAttentionBackend().forward(q_ref, k_ref, v, cache_torch, md, 0.25, kv_scale)
    backend = TritonAttentionBackend()
    assert backend.fuses_rope and not TorchAttentionBackend.fuses_rope
    got = backend.forward(q, k, v, cache_triton, md, 0.25, kv_scale,
                          rope=RopeInputs(positions, cos_sin, is_neox=True))
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(cache_triton.view(torch.uint8), cache_torch.view(torch.uint8))
    assert_close_for(got, want, torch.float32)


def test_triton_backend_with_channel_factors_matches_torch_backend() -> None:
    """An int8 cache with per-channel factors (engine/attention/kv_channels.py), as the attention
    layer applies them: q, k, v scaled in place (views of the fused QKV row), RoPE fused into the
    Triton write, the output scaled back. The Triton cache holds the torch reference's bytes;
    its values are rot(k) / (scale * f) within half a step; the output is unfactored attention
    over the cache dequantized with scale * f (float32 tolerance)."""
    from engine.attention.kv_channels import LayerChannelFactors

    gen = torch.Generator().manual_seed(11)
    md = _mixed_step_metadata()
    qkv, q, k, v = _qkv(6, torch.float32, gen)
    positions = torch.tensor([5, 4, 5, 6, 7, 8])
    cos_sin = _cos_sin(gen)
    # Pair-equal K factors (channels i and i + D/2), free V factors, on the 4-bit grid.
    half = HEAD_DIM // 2
    kf = (2.0 ** -torch.randint(0, 5, (NUM_KV_HEADS, half), generator=gen)).repeat(1, 2)
    vf = 2.0 ** -torch.randint(0, 5, (NUM_KV_HEADS, HEAD_DIM), generator=gen).float() * 1.5
    channels = LayerChannelFactors(kf, vf, NUM_HEADS, torch.device("cpu"), torch.float32)
    # Channels as large as their factors: the factored values fill the layer's range (|x| < 16
    # before RoPE, < 23 after it).
    k.mul_(kf)
    v.mul_(vf)
    k_scale, v_scale = 32.0 / 127, 24.0 / 127
    cache_triton = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                               dtype=torch.int8)
    cache_torch = cache_triton.clone()
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()  # unfactored, rotated by the reference
    R.rotary_embedding_ref(positions, q_ref, k_ref, cos_sin)
    # The torch backend over the factored q, k, v (reference rotation after the scaling).
    qkv_torch = qkv.clone()
    qt, kt, vt = channels.scale_qkv(*_split(qkv_torch))
    R.rotary_embedding_ref(positions, qt, kt, cos_sin)
    want = channels.scale_output(TorchAttentionBackend().forward(
        qt, kt, vt, cache_torch, md, 0.25, (k_scale, v_scale)))
    # The Triton backend: the same scaling, RoPE inside its write kernel.
    unscaled = qkv.clone()
    q3, k3, v3 = channels.scale_qkv(q, k, v)
    # In place: still views of the fused row, which holds the scaled values (piecewise graphs
    # read v back from their static QKV buffer for a fresh prompt's SDPA).
    assert [t.data_ptr() for t in (q3, k3, v3)] == [t.data_ptr() for t in (q, k, v)]
    assert torch.equal(_split(qkv)[2], _split(unscaled)[2] * channels.v_mul)
    got = channels.scale_output(TritonAttentionBackend().forward(
        q3, k3, v3, cache_triton, md, 0.25, (k_scale, v_scale),
        rope=RopeInputs(positions, cos_sin, is_neox=True)))
    assert torch.equal(cache_triton, cache_torch)
    slots = md.slot_mapping
    stored = cache_triton.reshape(2, -1, NUM_KV_HEADS, HEAD_DIM)[:, slots].float()
    step = torch.stack((k_scale * kf, v_scale * vf))[:, None]
    real = torch.stack((k_ref, v_ref))
    assert bool(((stored * step - real).abs() <= step / 2 + 1e-6).all())
    assert_close_for(got, want, torch.float32)
    dequantized = cache_triton.float() * step[:, None]  # [2, NB, BS, Hkv, D]: K, V themselves
    exact = TorchAttentionBackend().attend(q_ref, k_ref, v_ref, dequantized, md, 0.25)
    assert_close_for(got, exact, torch.float32)


def test_torch_backend_refuses_rope() -> None:
    md = _mixed_step_metadata()
    q, k = torch.zeros(6, NUM_HEADS, HEAD_DIM), torch.zeros(6, NUM_KV_HEADS, HEAD_DIM)
    rope = RopeInputs(torch.zeros(6, dtype=torch.int64), torch.zeros(MAX_POS, HEAD_DIM), True)
    with pytest.raises(ValueError, match="does not fuse RoPE"):
        TorchAttentionBackend().forward(q, k, k, torch.zeros(2, 6, 4, 2, 16), md, 0.25,
                                        rope=rope)


def test_engine_triton_backend_matches_torch_backend(tiny_model_dirs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every position's logits (chunked prefill, then decodes): the Triton backend (all its
    kernels, RoPE fused into the KV write) vs the torch reference backend, same tiny model."""
    fused_calls: list[int] = []
    fused = K.rotary_and_write_kv

    def spy(*args: object, **kwargs: object) -> None:
        fused_calls.append(1)
        fused(*args, **kwargs)  # type: ignore[arg-type]

    def unfused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model must not rotate q/k itself with a fusing backend")

    monkeypatch.setattr(K, "rotary_and_write_kv", spy)
    monkeypatch.setattr(K, "rotary_embedding", unfused)
    # Budget 5: steps of [a 4 + b 1], [a decode + b 4], [a decode + b 2], then two of two
    # decodes; both finish together, so no step has one row (which the Linear layers would send
    # through the GEMV, slow in the interpreter and not what this test is about).
    prompts = {"a": [5, 17, 99, 3], "b": [250, 7, 42, 8, 300, 11, 64]}
    max_tokens = {"a": 5, "b": 3}
    traces: dict[str, dict[str, Trace]] = {}
    for backend in ("torch", "triton"):
        llm = tiny_llm(tiny_model_dirs["llama"], attention_backend=backend,
                       max_num_batched_tokens=5, max_model_len=32)
        assert llm.engine.runner.backend.name == backend
        for rid, prompt in prompts.items():
            llm.engine.add_request(rid, prompt, greedy(max_tokens[rid]))
        traces[backend] = run_to_end(llm.engine)
    assert fused_calls, "the Triton backend never called the fused kernel"
    for rid in prompts:
        got, want = traces["triton"][rid], traces["torch"][rid]
        torch.testing.assert_close(got.logits_matrix(), want.logits_matrix(), atol=1e-4,
                                   rtol=1e-4, msg=rid)
        assert got.request.output_token_ids == want.request.output_token_ids


def _record_decode_query_lens(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The `query_len` of every later `paged_decode_attention` launch, appended as they run."""
    query_lens: list[int] = []
    decode = K.paged_decode_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        query_lens.append(int(kwargs.get("query_len", 1)))  # type: ignore[call-overload]
        return decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(K, "paged_decode_attention", spy)
    return query_lens


@pytest.mark.parametrize("verify_attention", ["decode", "prefill"])
def test_engine_verify_steps_through_the_decode_kernel(tiny_model_dirs: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       verify_attention: str) -> None:
    """Speculative verify steps laid out for the verify graphs (1 + 4 rows per sequence) run
    the split decode kernel with several query tokens (or, with SPLITSERVE_VERIFY_ATTENTION=
    prefill, the paged prefill kernel): the tokens are the torch backend's plain greedy ones,
    with drafts accepted and rejected."""
    from tests.unit.engine.test_spec_decode import _ScriptedProposer

    monkeypatch.setenv("SPLITSERVE_VERIFY_ATTENTION", verify_attention)

    prompts = {"a": [5, 17, 99, 3, 8, 21], "b": [250, 7, 42, 8, 300, 11, 64]}
    plain = {}
    ref = tiny_llm(tiny_model_dirs["llama"], max_model_len=32)
    for rid, prompt in prompts.items():
        ref.engine.add_request(rid, prompt, greedy(9))
    for rid, tr in run_to_end(ref.engine).items():
        plain[rid] = tr.request.output_token_ids
    query_lens = _record_decode_query_lens(monkeypatch)
    llm = tiny_llm(tiny_model_dirs["llama"], attention_backend="triton", max_model_len=32,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.engine.runner.verify_q_len = 5
    llm.engine.proposer = _ScriptedProposer(list(prompts.values()), list(plain.values()),
                                            wrong_from=2)
    for rid, prompt in prompts.items():
        llm.engine.add_request(rid, prompt, greedy(9))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            got[o.request_id].extend(o.new_token_ids)
    assert got == plain
    assert (5 in query_lens) == (verify_attention == "decode")
    sched = llm.engine.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    sched.check_integrity()


def test_verify_attention_switch_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_VERIFY_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SPLITSERVE_VERIFY_ATTENTION"):
        TritonAttentionBackend()


def test_graph_capture_only_through_a_capturable_backend(
        caplog: pytest.LogCaptureFixture) -> None:
    """A CUDA engine captures decode graphs through the Triton backend; through the torch
    backend (host reads of device values, which a capture forbids) it runs eagerly and says
    so, instead of failing its capture at start-up; the CPU and enforce_eager never capture."""
    from engine.runner.graph_capture import captures_cuda_graphs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert captures_cuda_graphs(cuda, False, TritonAttentionBackend())
    assert not captures_cuda_graphs(cuda, True, TritonAttentionBackend())
    assert not captures_cuda_graphs(cpu, False, TritonAttentionBackend())
    assert not caplog.records
    with caplog.at_level("WARNING", logger="engine.runner.graph_capture"):
        assert not captures_cuda_graphs(cuda, False, TorchAttentionBackend())
    assert "torch attention backend cannot be captured" in caplog.text
