"""The engine's model over the paged KV cache matches Hugging Face `transformers` (eager, float32).

Every position's logits are compared: each prefill chunk's rows and each decode step's row
(recorded through `scheduler.schedule()` + `runner.logits_for`) against HF's logits of the full
sequence (prompt + generated tokens). Greedy generation through `LLM.generate` (runner.execute +
sampler) must equal HF `generate(do_sample=False)` token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from engine.config import LoadConfig
from engine.llm import LLM
from engine.loader import load_model_source
from engine.request import Request
from tests.support.engine_driver import Trace, drive, greedy, run_to_end, tiny_llm
from tests.support.tiny_models import TINY_MODELS

ATOL = 1e-4
RTOL = 1e-4
NUM_DECODE = 6
# 13 and 7 prompt tokens: 4 and 2 blocks of 4; with 6 decode steps each spans several blocks.
PROMPTS = {"a": [5, 17, 99, 3, 250, 7, 42, 8, 300, 11, 64, 1, 200],
           "b": [9, 8, 7, 6, 5, 4, 383]}


def _hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[L, V] float32 logits of every position of `ids`."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _check_trace(model: PreTrainedModel, tr: Trace, start: int = 0) -> None:
    """Compare positions start.. (earlier ones may be prefix-cache hits, never computed)."""
    req = tr.request
    assert req.num_output_tokens == NUM_DECODE, req
    ours = tr.logits_matrix(start)  # positions start .. prompt + NUM_DECODE - 2
    ref = _hf_logits(model, req.all_token_ids[:-1])
    p = req.num_prompt_tokens
    torch.testing.assert_close(ours[:p - start], ref[start:p], atol=ATOL, rtol=RTOL,
                               msg=f"{req.request_id} prefill logits")
    for step in range(NUM_DECODE - 1):
        torch.testing.assert_close(ours[p - start + step], ref[p + step], atol=ATOL, rtol=RTOL,
                                   msg=f"{req.request_id} decode step {step}")
    # The tokens we fed back are HF's greedy choices too (the logits agree, so must the argmax).
    assert req.output_token_ids == ref[p - 1:].argmax(-1).tolist()


def _add(llm: LLM, rid: str, prompt: list[int]) -> Request:
    return llm.engine.add_request(rid, prompt, greedy(NUM_DECODE))


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_logits_match_hf_every_step(tiny_model_dirs: dict[str, Path],
                                    hf_reference: Callable[[str], PreTrainedModel],
                                    name: str, chunked: bool) -> None:
    budget = 5 if chunked else 64  # 5: the 13-token prompt takes three chunks
    llm = tiny_llm(tiny_model_dirs[name], max_num_batched_tokens=budget,
                   enable_chunked_prefill=chunked, enable_prefix_caching=True)
    ref = hf_reference(name)
    for rid, prompt in PROMPTS.items():
        _add(llm, rid, prompt)
    traces: dict[str, Trace] = {}
    steps = sum(1 for _ in drive(llm.engine, traces))
    assert steps >= NUM_DECODE + (2 if chunked else 0)
    for tr in traces.values():
        _check_trace(ref, tr)

    # A second request sharing the first 3 full blocks of "a": served from the prefix cache.
    shared = [*PROMPTS["a"][:12], 77, 78, 79]
    req = _add(llm, "c", shared)
    traces = run_to_end(llm.engine)
    assert req.num_cached_tokens == 12
    assert llm.engine.kv.prefix_cache_hits >= 12
    assert min(traces["c"].logits) == 12  # cached positions were not recomputed
    _check_trace(ref, traces["c"], start=12)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("name", TINY_MODELS)
def test_greedy_generate_equals_hf_generate(tiny_model_dirs: dict[str, Path],
                                            hf_reference: Callable[[str], PreTrainedModel],
                                            name: str) -> None:
    llm = tiny_llm(tiny_model_dirs[name], max_num_batched_tokens=6)
    ref = hf_reference(name)
    n = 10
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS.values()], greedy(n))
    for prompt, out in zip(PROMPTS.values(), outs, strict=True):
        generate: Any = ref.generate  # transformers' stubs type it as a Tensor attribute
        with torch.no_grad():
            seq = generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                           dtype=torch.long), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        want = seq[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert len(set(outs[0].outputs[0].token_ids)) > 1, "degenerate tiny model"


# ---- SmolLM2 (the embedded default GGUF) ---------------------------------------------------------

def test_smollm2_answers_paris(smollm2: LLM) -> None:
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       greedy(12))
    assert "Paris" in out[0].outputs[0].text


def _hf_from_our_weights() -> PreTrainedModel:
    """transformers' Llama on the same dequantized GGUF weights (transformers' own GGUF reader
    needs `accelerate`, which is not installed): config and weights from our loader."""
    source = load_model_source(LoadConfig())
    assert source.weights is not None
    model = LlamaForCausalLM(LlamaConfig(**source.config.to_hf_dict()))
    missing, unexpected = model.load_state_dict(dict(source.weights()), strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    model.tie_weights()
    model.config._attn_implementation = "eager"
    model.float()
    return model.eval()


def test_smollm2_logits_match_hf(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog because")
    smollm2.engine.add_request("smol-logits", ids, greedy(3))
    tr = run_to_end(smollm2.engine)["smol-logits"]
    ours = tr.logits_matrix()
    ref = _hf_logits(_hf_from_our_weights(), tr.request.all_token_ids[:-1])
    # 30 layers of float32 with differently ordered (fused) matmuls: a little looser.
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert tr.request.output_token_ids == ref[len(ids) - 1:].argmax(-1).tolist()
