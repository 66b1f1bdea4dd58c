"""Mixture-of-experts on the Triton path (CPU, TRITON_INTERPRET=1, small shapes): the pair
layouts, the grouped GEMM against per-pair matmuls, the fused experts against the torch loop
(`experts_torch`, which tests/unit/engine/test_model_vs_hf.py checks against `transformers` through the
whole model), and a tiny Qwen3-MoE engine on the Triton backend against the torch backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.moe import experts_fused, experts_torch, route
from tests.support.engine_driver import assert_backends_agree, traces_by_backend
from tests.support.interpret import interpret_or_skip, interpreted_kernels

K = interpreted_kernels()
from engine.kernels import fused_moe  # noqa: E402 - loaded (interpreted) above


@pytest.fixture()
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_or_skip(monkeypatch, fused_moe._moe_gemm_kernel)


def _ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """Distinct experts per token, as top-k picks them; skewed so some experts get none."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen) * torch.linspace(1, 3, experts)
    return scores.topk(top_k, dim=-1).indices


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("tokens", [1, 7, 50])
def test_align_pairs_groups_every_pair_once_by_expert(tokens: int, block_m: int,
                                                      use_kernel: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if use_kernel:
        interpret_or_skip(monkeypatch, fused_moe._align_kernel)
    experts, top_k = 8, 3
    ids = _ids(tokens, top_k, experts, seed=tokens)
    layout = fused_moe.align_pairs(ids, experts, block_m, use_kernel=use_kernel)
    n = ids.numel()
    rows = layout.sorted_pairs.tolist()
    used = int(layout.rows_used.item())
    assert used % block_m == 0 and used <= len(rows)
    assert sorted(p for p in rows if p < n) == list(range(n))  # each pair exactly once
    assert all(p == n for p in rows[used:])  # nothing past the used rows
    flat = ids.reshape(-1).tolist()
    for tile in range(used // block_m):
        expert = int(layout.tile_expert[tile])
        pairs = [p for p in rows[tile * block_m:(tile + 1) * block_m] if p < n]
        assert pairs, f"tile {tile} carries no pair"
        assert all(flat[p] == expert for p in pairs)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    # Stable: within an expert's rows, pairs in their own order.
    for expert in range(experts):
        mine = [p for p in rows if p < n and flat[p] == expert]
        assert mine == sorted(mine)


@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(200, 16, 2), (33, 128, 8)])
def test_the_sorting_kernel_lays_pairs_out_as_the_torch_ops_do(tokens: int, experts: int,
                                                                top_k: int) -> None:
    """Several of the kernel's 64-pair chunks, experts with no pair, 128 experts (every tile
    row of the expert map in its 64-tile chunks)."""
    ids = _ids(tokens, top_k, experts, seed=experts)
    for block_m in (16, 64):
        a = fused_moe.align_pairs(ids, experts, block_m, use_kernel=True)
        b = fused_moe.align_pairs(ids, experts, block_m, use_kernel=False)
        assert torch.equal(a.sorted_pairs, b.sorted_pairs)
        assert torch.equal(a.tile_expert, b.tile_expert)
        assert torch.equal(a.rows_used, b.rows_used)


def _dense_reference(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, gather: bool,
                     routing: torch.Tensor | None) -> torch.Tensor:
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    rows = [a[p // top_k] if gather else a[p] for p in range(flat.numel())]
    out = torch.stack([w[int(flat[p])].float() @ rows[p].float() for p in range(len(rows))])
    if routing is not None:
        out = out * routing[:, None]
    return out


@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [2, 40], ids=["per_pair", "sorted"])
def test_moe_gemm_matches_per_pair_matmuls(tokens: int, dtype: torch.dtype) -> None:
    experts, top_k, k_in, n_out = 6, 2, 48, 40  # K and N not multiples of the tiles
    gen = torch.Generator().manual_seed(1)
    ids = _ids(tokens, top_k, experts, seed=2)
    x = torch.randn(tokens, k_in, generator=gen).to(dtype)
    w = torch.randn(experts, n_out, k_in, generator=gen).to(dtype)
    layout = fused_moe.layout_for(ids, experts)
    assert (layout.block_m == 16 and layout.sorted_pairs.numel() == ids.numel() * 16) == (
        tokens == 2)
    got = fused_moe.moe_gemm(x, w, layout, top_k, gather_tokens=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), _dense_reference(x, w, ids, True, None),
                               atol=tol * k_in ** 0.5, rtol=tol)
    routing = torch.rand(ids.numel(), generator=gen)
    per_pair = torch.randn(ids.numel(), k_in, generator=gen).to(dtype)
    got = fused_moe.moe_gemm(per_pair, w, layout, top_k, gather_tokens=False,
                             routing_weights=routing)
    torch.testing.assert_close(got.float(), _dense_reference(per_pair, w, ids, False, routing),
                               atol=tol * k_in ** 0.5, rtol=tol)


@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize("tokens", [2, 40], ids=["per_pair", "sorted"])
def test_int8_experts_match_their_dequantized_weights(tokens: int) -> None:
    """W8A16: the grouped GEMM on int8 weights with per-channel scales is the float GEMM on
    q * scale; the fused layer equals the torch loop on the same int8 experts."""
    from engine.model.quant import quantize_weight_int8

    experts, top_k, hidden, inter = 6, 2, 32, 16
    gen = torch.Generator().manual_seed(tokens)
    ids = _ids(tokens, top_k, experts, seed=5)
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    q, scale = quantize_weight_int8(w.reshape(-1, hidden))
    q, scale = q.view(w.shape), scale.view(experts, 2 * inter)
    layout = fused_moe.layout_for(ids, experts)
    got = fused_moe.moe_gemm(x, q, layout, top_k, gather_tokens=True, weight_scale=scale)
    want = _dense_reference(x, q.float() * scale[:, :, None], ids, True, None)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(K.KernelInputError, match="weight_scale"):
        fused_moe.moe_gemm(x, q, layout, top_k, gather_tokens=True, weight_scale=scale.T)
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    dq, dscale = quantize_weight_int8(down.reshape(-1, inter))
    dq, dscale = dq.view(down.shape), dscale.view(experts, hidden)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, True)
    torch.testing.assert_close(
        experts_fused(x, q, dq, weights, ids, scale, dscale),
        experts_torch(x, q, dq, weights, ids, scale, dscale), atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("_interpret")
def test_moe_int8_engine_triton_path_matches_torch_path(tiny_model_dirs: dict[str, Path]
                                                        ) -> None:
    """`--quantization int8` on a mixture of experts quantizes the experts too (the Triton
    path's int8 grouped GEMM against the torch loop's dequantized matmuls)."""
    prompts = {"a": [5, 17, 99, 3, 250, 7, 42], "b": [9, 8, 7]}
    traces = traces_by_backend(tiny_model_dirs["qwen2moe"], prompts, quantization="int8",
                               max_num_batched_tokens=6, max_model_len=32)
    assert set(traces["torch"]) == set(prompts)
    assert_backends_agree(traces, tol=1e-3)


@pytest.mark.usefixtures("_interpret")
def test_moe_gemm_refuses_bad_inputs() -> None:
    ids = _ids(3, 2, 4, seed=0)
    layout = fused_moe.layout_for(ids, 4)
    w = torch.randn(4, 16, 32)
    with pytest.raises(K.KernelInputError, match="columns"):
        fused_moe.moe_gemm(torch.randn(3, 16), w, layout, 2, gather_tokens=True)
    with pytest.raises(K.KernelInputError, match="rows"):
        fused_moe.moe_gemm(torch.randn(5, 32), w, layout, 2, gather_tokens=True)
    with pytest.raises(K.KernelInputError, match="float32, one per pair"):
        fused_moe.moe_gemm(torch.randn(6, 32), w, layout, 2, gather_tokens=False,
                           routing_weights=torch.ones(5))


@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize("tokens", [1, 5, 45])
def test_fused_experts_match_the_torch_loop(tokens: int) -> None:
    experts, top_k, hidden, inter = 8, 2, 32, 16
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    router = torch.randn(experts, hidden, generator=gen)
    weights, ids = route(x @ router.T, top_k, renormalise=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    want = experts_torch(x, gate_up, down, weights, ids)
    got = experts_fused(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("_interpret")
def test_moe_engine_triton_path_matches_torch_path(tiny_model_dirs: dict[str, Path]) -> None:
    """A chunked prompt, a short one decoding beside it, a prefix hit: same logits."""
    prompts = {"a": [5, 17, 99, 3, 250, 7, 42, 8, 300], "b": [9, 8, 7],
               "again": [5, 17, 99, 3, 250, 7, 42, 8, 11, 12]}
    traces = traces_by_backend(tiny_model_dirs["qwen3moe"], prompts, max_num_batched_tokens=6,
                               max_model_len=32)
    assert set(traces["torch"]) == set(prompts)
    assert_backends_agree(traces, tol=1e-4)


@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize(("experts", "top_k", "renormalise"),
                         [(8, 2, True), (60, 4, False), (128, 8, True), (5, 5, True)])
def test_route_kernel_matches_torch_routing(experts: int, top_k: int, renormalise: bool) -> None:
    gen = torch.Generator().manual_seed(experts)
    logits = torch.randn(9, experts, generator=gen) * 3
    want_w, want_ids = route(logits, top_k, renormalise)
    got_w, got_ids = fused_moe.route_topk(logits, top_k, renormalise)
    assert got_ids.tolist() == want_ids.tolist()  # largest first, as torch.topk orders them
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    with pytest.raises(K.KernelInputError, match="top_k"):
        fused_moe.route_topk(logits, experts + 1, renormalise)


def test_moe_configs_are_read_and_what_is_missing_refused() -> None:
    from engine.config import ConfigError, ModelConfig
    from engine.llm import LLM
    from engine.loader.presets import preset_config

    qwen = ModelConfig.from_hf_dict(preset_config("qwen3-30b-a3b"))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    assert qwen.qk_norm and qwen.norm_topk_prob and qwen.is_sparse_layer(47)
    assert ModelConfig.from_hf_dict(qwen.to_hf_dict()) == qwen  # what the fingerprint hashes
    mixtral = ModelConfig.from_hf_dict(preset_config("mixtral-8x7b"))
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size == 14336
    every = ModelConfig.from_hf_dict({**preset_config("tiny-moe"), "decoder_sparse_step": 2,
                                      "mlp_only_layers": [1]})
    assert [every.is_sparse_layer(i) for i in range(4)] == [False, False, False, True]
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size is Qwen2-MoE's"):
        ModelConfig.from_hf_dict({**preset_config("tiny-moe"),
                                  "shared_expert_intermediate_size": 64})
    qwen2 = ModelConfig.from_hf_dict({**preset_config("tiny-moe"),
                                      "architectures": ["Qwen2MoeForCausalLM"],
                                      "shared_expert_intermediate_size": 64})
    assert qwen2.attention_bias and not qwen2.qk_norm  # qkv_bias: on unless said otherwise
    assert ModelConfig.from_hf_dict(qwen2.to_hf_dict()) == qwen2
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**preset_config("tiny-moe"), "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match=r"'fp8' .* experts of a mixture-of-experts model"):
        LLM(model="dummy:tiny-moe", device="cpu", dtype="float32", quantization="fp8")
    int8 = LLM(model="dummy:tiny-moe", device="cpu", dtype="float32", quantization="int8")
    experts = int8.engine.runner.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.int8 and experts.down_scale is not None


def test_int8_experts_keep_the_float_models_tokens(tiny_model_dirs: dict[str, Path]) -> None:
    """Weight-only int8 (experts, shared expert and attention) against the float32 model on the
    torch path: the same greedy tokens, logits within a few percent of their scale."""
    from tests.support.engine_driver import greedy, run_to_end, tiny_llm

    prompts = {"a": [5, 17, 99, 3, 250, 7, 42], "b": [9, 8, 7]}
    traces = {}
    for quant in ("none", "int8"):
        llm = tiny_llm(tiny_model_dirs["qwen2moe"], quantization=quant)
        for rid, prompt in prompts.items():
            llm.engine.add_request(rid, prompt, greedy(6))
        traces[quant] = run_to_end(llm.engine)
    for rid in prompts:
        full, int8 = traces["none"][rid], traces["int8"][rid]
        assert int8.request.output_token_ids == full.request.output_token_ids
        ref = full.logits_matrix()
        assert ((int8.logits_matrix() - ref).abs().max() / ref.abs().max()).item() < 0.1
