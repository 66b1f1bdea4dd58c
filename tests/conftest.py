"""Shared fixtures for the engine tests: tiny random Hugging Face model directories (Llama with
plain RoPE, Llama with llama3 RoPE scaling and tied embeddings, Qwen2 with QKV bias, Qwen3 with
q/k norms and a head_dim that is not hidden / heads, Phi-3 with fused checkpoint weights, three
mixtures of experts: Qwen3-MoE, Qwen2-MoE and Mixtral, and sliding windows shorter than the
tests' prompts: Mistral's on every layer, Gemma 2's and Gemma 3's on some; Gemma 3's language
model also inside a Gemma3ForConditionalGeneration with a vision tower), one session-wide
SmolLM2 engine, and a scheduler-level driver that records every position's logits.

The tiny models are written with transformers' `save_pretrained(safe_serialization=True)`, so
the engine's loader reads exactly what `transformers` reads back as the reference.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SiglipVisionConfig,
)

from engine.attention.forward_context import AttentionMetadata
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine.request import Request
from engine.scheduler import SampledToken
from engine_api.sampling_params import SamplingParams

# Small enough for 2 shared CPU cores; 4 heads over 2 KV heads exercises GQA.
TINY_ARCH: dict[str, Any] = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

TINY_MODELS = ("llama", "llama3", "qwen2", "qwen3", "phi3", "qwen3moe", "qwen2moe", "mixtral",
               "mistral_swa", "gemma2", "gemma3", "gemma3mm")
# The mixtures of experts: 8 experts, 2 per token (Qwen3-MoE renormalising, with a dense MLP in
# its last layer; Qwen2-MoE the same plus a gated shared expert and QKV bias); Mixtral's 4
# experts, 2 per token.
MOE_ARCH: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])


# Gemma's windowed layers: windows of 5 (Gemma 2, and Mistral's) and 6 positions (Gemma 3),
# which the 13-token prompt outgrows; Gemma 2 with attention scores capped at 5 and logits at
# 2.5, its embeddings untied (tied, the sqrt(hidden)-scaled input embedding makes the random
# model repeat its last token; Gemma 3 ties them); Gemma 3 with local and global RoPE tables
# apart (the global one linearly scaled). Layer 0 slides, layer 1 attends to all.
GEMMA_ARCH: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention"])
# Gemma 3 4B/12B/27B's checkpoints: the language model beside a SigLIP vision tower (here one
# layer over 2 x 2 patches) and its projector, which the engine does not load.
TINY_SIGLIP: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)


def _gemma3_text_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(**TINY_ARCH, **GEMMA_ARCH, sliding_window=6, rope_theta=1e4,
                            rope_local_base_freq=100.0,
                            rope_scaling={"rope_type": "linear", "factor": 2.0})


def _randomize(model: PreTrainedModel, seed: int) -> None:
    """Spread every parameter (norm weights and biases too, which HF initialises to 1 and 0) so
    a wrong bias / norm / projection load cannot hide, and greedy outputs are not degenerate.
    Gemma's norms scale by 1 + w (w initialised to 0), so theirs by about 2 here."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def _build(name: str) -> PreTrainedModel:
    torch.manual_seed(0)
    # RoPE options as a dict: transformers 5 maps these legacy keys onto `rope_parameters`.
    rope: dict[str, Any] = {"rope_theta": 10000.0}
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY_ARCH, **rope, tie_word_embeddings=False))
    if name == "llama3":
        rope["rope_scaling"] = dict(LLAMA3_ROPE)
        return LlamaForCausalLM(LlamaConfig(**TINY_ARCH, **rope, tie_word_embeddings=True))
    if name == "qwen2":
        rope["rope_theta"] = 1e6
        return Qwen2ForCausalLM(Qwen2Config(**TINY_ARCH, **rope, tie_word_embeddings=False))
    if name == "qwen3":
        rope["rope_theta"] = 1e6  # head_dim 32: 4 heads x 32 = 128 query features, hidden 64
        return Qwen3ForCausalLM(Qwen3Config(**TINY_ARCH, **rope, head_dim=32,
                                            tie_word_embeddings=True))
    if name == "phi3":
        return Phi3ForCausalLM(Phi3Config(**TINY_ARCH, **rope, tie_word_embeddings=False))
    if name == "qwen3moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_ARCH, **rope, **MOE_ARCH, head_dim=16,
                                                  tie_word_embeddings=False))
    if name == "qwen2moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(**TINY_ARCH, **rope, **MOE_ARCH,
                                                  shared_expert_intermediate_size=48,
                                                  tie_word_embeddings=False))
    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**TINY_ARCH, **rope, num_local_experts=4,
                                                num_experts_per_tok=2, sliding_window=None,
                                                tie_word_embeddings=False))
    if name == "mistral_swa":
        return MistralForCausalLM(MistralConfig(**TINY_ARCH, **rope, sliding_window=5,
                                                tie_word_embeddings=False))
    if name == "gemma2":
        return Gemma2ForCausalLM(Gemma2Config(**TINY_ARCH, **rope, **GEMMA_ARCH, sliding_window=5,
                                              attn_logit_softcapping=5.0,
                                              final_logit_softcapping=2.5,
                                              tie_word_embeddings=False))
    if name == "gemma3":
        return Gemma3ForCausalLM(_gemma3_text_config())
    if name == "gemma3mm":  # the image token ids are out of the tiny vocabulary: never prompted
        return Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=_gemma3_text_config(), vision_config=SiglipVisionConfig(**TINY_SIGLIP),
            mm_tokens_per_image=4))
    raise ValueError(f"unknown tiny model {name!r}")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> HF directory (config.json + model.safetensors) for each of TINY_MODELS."""
    dirs: dict[str, Path] = {}
    for i, name in enumerate(TINY_MODELS):
        model = _build(name)
        _randomize(model, seed=100 + i)
        path = tmp_path_factory.mktemp(f"tiny_{name}")
        model.save_pretrained(path, safe_serialization=True)
        dirs[name] = path
    return dirs


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dirs: dict[str, Path]) -> Callable[[str], PreTrainedModel]:
    """name -> the transformers model read back from the saved dir (eager attention, float32)."""
    cache: dict[str, PreTrainedModel] = {}

    def get(name: str) -> PreTrainedModel:
        if name not in cache:
            cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                   "phi3": Phi3ForCausalLM, "qwen3moe": Qwen3MoeForCausalLM,
                   "qwen2moe": Qwen2MoeForCausalLM, "mixtral": MixtralForCausalLM,
                   "mistral_swa": MistralForCausalLM, "gemma2": Gemma2ForCausalLM,
                   "gemma3": Gemma3ForCausalLM,
                   "gemma3mm": Gemma3ForConditionalGeneration}.get(name, LlamaForCausalLM)
            model = cls.from_pretrained(tiny_model_dirs[name], attn_implementation="eager",
                                        dtype=torch.float32)
            cache[name] = model.eval()
        return cache[name]

    return get


def interpret_or_skip(monkeypatch: pytest.MonkeyPatch, kernel: object) -> None:
    """Run this test's Triton kernels under the interpreter; skip it when `kernel` (one of the
    module's, imported through `interpreted_kernel_imports`) was compiled for a GPU because
    another module imported the kernels first with the interpreter off."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if type(kernel).__name__ != "InterpretedFunction":
        pytest.skip("kernels were compiled for a GPU before this module set TRITON_INTERPRET")


@contextlib.contextmanager
def interpreted_kernel_imports() -> Iterator[None]:
    """Kernel modules imported inside see TRITON_INTERPRET=1 (Triton decides at decoration time
    whether a kernel is interpreted); the variable is restored after, so other test modules do
    not see a "GPU". Skips the importing module when Triton is not installed."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton", reason="Triton is not installed")
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def interpreted_kernels() -> ModuleType:
    """`engine.kernels` with every kernel module loaded now under the interpreter (they load
    lazily: a module first touched later, with the interpreter off, would compile for a GPU)."""
    with interpreted_kernel_imports():
        from engine import kernels

        for name in kernels.__all__:
            getattr(kernels, name)
    return kernels


def tiny_llm(path: Path, **kwargs: Any) -> LLM:
    """An engine over a tiny HF dir: float32 on the CPU, 4-token blocks (many per sequence)."""
    opts: dict[str, Any] = dict(dtype="float32", block_size=4, device="cpu", max_num_seqs=32)
    opts.update(kwargs)
    return LLM(model=str(path), **opts)


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    """The default SmolLM2-135M-Instruct GGUF engine (loaded once: it takes ~20 s on 2 cores)."""
    return LLM(num_gpu_blocks=512, device="cpu")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---- a scheduler-level driver that keeps every position's logits -------------------------------

@dataclass
class Trace:
    """What one request saw: logits of each position it computed (last computation wins)."""

    request: Request
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [V]

    def logits_matrix(self, start: int = 0) -> torch.Tensor:
        """[L - start, V] logits of positions start..L-1, L = prompt + outputs - 1 (the last
        sampled token is never fed back). Positions before `start` may come from the prefix cache."""
        n = self.request.num_tokens - 1
        missing = [p for p in range(start, n) if p not in self.logits]
        assert not missing, f"{self.request.request_id}: positions never computed: {missing}"
        return torch.stack([self.logits[p] for p in range(start, n)])


def drive(engine: LLMEngine, traces: dict[str, Trace] | None = None) -> Iterator[dict[str, Trace]]:
    """Run the engine's scheduler to completion with greedy sampling, recording every logit row.

    Uses `scheduler.schedule()` + `runner.logits_for(out)` (the same input preparation and forward
    as `runner.execute`) so each prefill chunk's and each decode step's logits can be compared
    with the reference. Yields the traces after every step (so callers can inspect mid-flight).
    """
    sched = engine.scheduler
    traces = {} if traces is None else traces
    for req in list(sched.requests.values()):
        traces.setdefault(req.request_id, Trace(req))
    while sched.has_work():
        out = sched.schedule()
        assert not out.is_empty, "scheduler made no progress"
        logits = engine.runner.logits_for(out)  # [T, V]
        row = 0
        sampled: dict[str, SampledToken] = {}
        for s in out.scheduled:
            tr = traces.setdefault(s.request.request_id, Trace(s.request))
            for j in range(s.num_new_tokens):
                tr.logits[s.num_computed_tokens + j] = logits[row + j].clone()
            row += s.num_new_tokens
            if s.sample:
                sampled[s.request.request_id] = SampledToken(int(logits[row - 1].argmax()))
        assert row == logits.shape[0]
        sched.update_from_output(out, sampled)
        sched.check_integrity()
        yield traces


def run_to_end(engine: LLMEngine) -> dict[str, Trace]:
    """`drive` until no work is left; the traces of every request seen."""
    traces: dict[str, Trace] = {}
    for _ in drive(engine, traces):
        pass
    return traces


def traces_by_backend(path: Path, prompts: dict[str, list[int]], max_tokens: int = 3,
                      **kwargs: Any) -> dict[str, dict[str, Trace]]:
    """backend ("torch", "triton") -> every request's trace: `prompts` run greedily on an
    engine of each attention backend (the Triton one under the interpreter on the CPU)."""
    out: dict[str, dict[str, Trace]] = {}
    for backend in ("torch", "triton"):
        llm = tiny_llm(path, attention_backend=backend, **kwargs)
        for rid, prompt in prompts.items():
            llm.engine.add_request(rid, prompt, greedy(max_tokens))
        out[backend] = run_to_end(llm.engine)
    return out


def assert_backends_agree(traces: dict[str, dict[str, Trace]], tol: float,
                          same_tokens: bool = False) -> None:
    """`traces_by_backend`'s two engines computed the same logits (within `tol`) for every
    request, from the same first computed position (a prefix hit's tail on both); with
    `same_tokens`, sampled the same tokens too."""
    for rid, want in traces["torch"].items():
        got = traces["triton"][rid]
        start = min(got.logits)
        assert start == min(want.logits), rid
        torch.testing.assert_close(got.logits_matrix(start), want.logits_matrix(start),
                                   atol=tol, rtol=tol, msg=rid)
        if same_tokens:
            assert got.request.output_token_ids == want.request.output_token_ids, rid


# Prompts of the quantized-cache accuracy tests (fp8 and int8 KV against the float32 cache).
AGREEMENT_TEXTS = ("The capital of France is", "def fibonacci(n):",
                   "Once upon a time, there was a", "The three primary colors are",
                   "In machine learning, overfitting means")


def teacher_forced_agreement(reference: LLM, candidate: LLM, max_tokens: int = 24
                             ) -> tuple[int, int]:
    """`reference`'s greedy continuation of AGREEMENT_TEXTS, fed whole to `candidate`: at how
    many of its positions `candidate`'s argmax is the reference's token (agreeing, total)."""
    tok = reference.engine.tokenizer
    assert tok is not None
    prompts = [tok.encode(t) for t in AGREEMENT_TEXTS]
    outs = reference.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens))
    agree = total = 0
    for i, (prompt, res) in enumerate(zip(prompts, outs, strict=True)):
        out = res.outputs[0].token_ids
        candidate.engine.add_request(f"t{i}", prompt + out[:-1], greedy(1))
        trace = run_to_end(candidate.engine)[f"t{i}"]
        argmax = trace.logits_matrix()[len(prompt) - 1:].argmax(-1)
        agree += int((argmax == torch.tensor(out)).sum())
        total += len(out)
    return agree, total


def mixed_step_metadata(block_size: int = 4) -> AttentionMetadata:
    """A mixed step for the quantized-cache backend tests: one decode (6 tokens) and one 5-token
    prefill chunk over a cached 4-token prefix (9 tokens); block tables [[5, 2, 0], [1, 7, 3]],
    the chunk's K/V written to block 7 and block 3."""
    bs = block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32),
        block_tables=torch.tensor([[5, 2, 0], [1, 7, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([2 * bs + 1, 3 * bs + 0] + [7 * bs + i for i in range(4)]),
        num_decodes=1, max_query_len=5, max_seq_len=9,
        query_start_loc_cpu=[0, 1, 6], seq_lens_cpu=[6, 9])


# ---- driving an engine step by step --------------------------------------------------------

def run_steps(llm: LLM, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
              abort_after: dict[str, int] | None = None, max_steps: int = 1000, **add: Any
              ) -> tuple[dict[str, list[StepOutput]], int]:
    """Add requests r0, r1, ... and step the engine until none is left; returns every
    request's step outputs and the step count. `abort_after`: request id -> abort once it has
    that many outputs. `add`: more `add_request` keywords. Checks that no KV block leaked."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp, **add)
    outs: dict[str, list[StepOutput]] = {f"r{i}": [] for i in range(len(params))}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
            if abort_after and len(outs[o.request_id]) == abort_after.get(o.request_id):
                eng.abort_request(o.request_id)
        steps += 1
        assert steps < max_steps
    eng.scheduler.check_integrity()
    assert not eng.kv.req_to_blocks, "blocks still held after every request ended"
    return outs, steps


def step_tokens(outs: dict[str, list[StepOutput]]) -> dict[str, list[int]]:
    """Each request's output tokens, from `run_steps`' outputs."""
    return {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}
