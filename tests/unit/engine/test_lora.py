"""LoRA adapters (PEFT format) beside the base model, chosen per request.

The oracle is PEFT's definition: a targeted projection's weight becomes `W + scaling · B A`.
Each request's logits, at every position it computes, must equal `transformers` over the base
weights with its own adapter merged in — while requests of other adapters and of the base
model share its steps. Adapter and base KV never share prefix-cache blocks. What is not
implemented is refused by name, at start or per request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.config import ConfigError
from engine.lora import LoRAError, LoRARequest
from engine.lora.adapter import TARGETS
from engine_api.errors import EngineInputError
from tests.support.engine_driver import greedy, run_to_end, tiny_llm
from tools.gpu.gpu_lora_check import write_adapter

ATOL = RTOL = 1e-4
PROMPTS = {"base": [5, 17, 99, 3, 250, 7, 42, 8, 300, 11],
           "attn": [9, 8, 7, 6, 5, 4, 383, 2, 77],
           "all": [5, 17, 99, 3, 250, 7, 42, 8, 300, 11]}  # "base"'s prompt under an adapter


def merged(base: PreTrainedModel, weights: dict[tuple[int, str], tuple[torch.Tensor,
                                                                         torch.Tensor]],
           scaling: float) -> PreTrainedModel:
    """A copy of `base` with the adapter merged: W += scaling * B @ A (PEFT's merge)."""
    import copy
    model = copy.deepcopy(base)
    with torch.no_grad():
        for (layer, t), (a, b) in weights.items():
            block = model.model.layers[layer]
            module = getattr(block.mlp if t in ("gate_proj", "up_proj", "down_proj")
                             else block.self_attn, t)
            module.weight += scaling * (b @ a)
    return model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]
             ) -> Callable[[str], dict[str, tuple[Path, dict, float]]]:
    """model name -> {adapter name: (dir, weights, scaling)}: "attn" (q, v, o at rank 4,
    alpha 8: scaling 2) and "all" (every projection at rank 8, rsLoRA: alpha / sqrt(r))."""
    made: dict[str, dict[str, tuple[Path, dict, float]]] = {}

    def get(name: str) -> dict[str, tuple[Path, dict, float]]:
        if name not in made:
            made[name] = write_test_adapters(tmp_path_factory.mktemp(f"lora_{name}"),
                                             tiny_model_dirs[name])
        return made[name]

    return get


def write_test_adapters(root: Path, model_dir: Path) -> dict[str, tuple[Path, dict, float]]:
    """`adapters`' two adapters of the model in `model_dir`, written under `root`."""
    from engine.config import LoadConfig
    from engine.loader import load_model_source

    cfg = load_model_source(LoadConfig(model=str(model_dir))).config
    attn = write_adapter(root / "attn", cfg, ("q_proj", "v_proj", "o_proj"), 4, 8, 1)
    every = write_adapter(root / "all", cfg, TARGETS, 8, 16, 2, use_rslora=True)
    return {"attn": (root / "attn", attn, 2.0), "all": (root / "all", every, 16 / 8 ** 0.5)}


def _hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_each_request_runs_its_own_adapter(
        tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], PreTrainedModel],
        adapters: Callable[[str], dict[str, tuple[Path, dict, float]]], name: str) -> None:
    """Base, "attn" and "all" requests in the same steps (chunked prefill: 6-token budget,
    then decodes): every computed position's logits equal HF's with that request's adapter
    merged; the same prompt under an adapter finds none of the base model's cached blocks."""
    made = adapters(name)
    llm = tiny_llm(tiny_model_dirs[name], max_num_batched_tokens=6,
                   lora_modules={k: str(v[0]) for k, v in made.items()})
    base = hf_reference(name)
    oracles = {"base": base, **{k: merged(base, w, s) for k, (_, w, s) in made.items()}}
    for rid, prompt in PROMPTS.items():
        llm.engine.add_request(rid, prompt, greedy(5),
                               lora_name=None if rid == "base" else rid)
    traces = run_to_end(llm.engine)
    for rid, tr in traces.items():
        r = tr.request
        ours = tr.logits_matrix(r.num_cached_tokens)
        want = _hf_logits(oracles[rid], r.all_token_ids[:-1])[r.num_cached_tokens:]
        torch.testing.assert_close(ours, want, atol=ATOL, rtol=RTOL, msg=rid)
    # "base" and "all" share a prompt: KV of different models, so no block is shared.
    assert traces["all"].request.num_cached_tokens == 0
    # The same adapter and prompt again: its own cached blocks serve it.
    again = llm.engine.add_request("again", PROMPTS["all"], greedy(2), lora_name="all")
    run_to_end(llm.engine)
    assert again.num_cached_tokens == 8
    llm.shutdown()


def test_offline_api_and_refusals(tiny_model_dirs: dict[str, Path],
                                  adapters: Callable[[str], dict[str, tuple[Path, dict, float]]],
                                  tmp_path: Path) -> None:
    made = adapters("llama")
    path = tiny_model_dirs["llama"]
    llm = tiny_llm(path, lora_modules={"attn": str(made["attn"][0])})
    prompt = [{"prompt_token_ids": PROMPTS["attn"]}]
    with_lora = llm.generate(prompt, greedy(6), lora_request="attn")[0].outputs[0].token_ids
    as_vllm = llm.generate(prompt, greedy(6), lora_request=LoRARequest(
        "attn", 1, str(made["attn"][0])))[0].outputs[0].token_ids
    without = llm.generate(prompt, greedy(6))[0].outputs[0].token_ids
    assert with_lora == as_vllm != without
    # One adapter (or none) per prompt, as vLLM accepts a list.
    mixed = llm.generate(prompt * 2, greedy(6), lora_request=["attn", None])
    assert [o.outputs[0].token_ids for o in mixed] == [with_lora, without]
    with pytest.raises(EngineInputError, match="1 LoRA requests for 2 prompts"):
        llm.generate(prompt * 2, greedy(2), lora_request=["attn"])
    assert llm.engine.runner.num_lora_steps > 0  # its steps ran eagerly, with the deltas
    with pytest.raises(EngineInputError, match=r"unknown LoRA adapter 'nope'.*attn"):
        llm.generate(prompt, greedy(2), lora_request="nope")
    with pytest.raises(ValueError, match="was loaded from"):
        llm.generate(prompt, greedy(2), lora_request=LoRARequest("attn", 1, str(tmp_path)))
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()

    plain = tiny_llm(path)
    with pytest.raises(EngineInputError, match="serves none"):
        plain.generate(prompt, greedy(2), lora_request="attn")
    plain.shutdown()

    cfg_dir = made["all"][0]
    cases = [({"use_dora": True}, "DoRA"), ({"bias": "all"}, "biases"),
             ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"r": 64}, "rank r=64")]
    for i, (change, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        (bad / "adapter_model.safetensors").write_bytes(
            (cfg_dir / "adapter_model.safetensors").read_bytes())
        d = json.loads((cfg_dir / "adapter_config.json").read_text()) | change
        (bad / "adapter_config.json").write_text(json.dumps(d))
        with pytest.raises(LoRAError, match=message):
            tiny_llm(path, lora_modules={"bad": str(bad)}, max_lora_rank=32)
    wrong = tmp_path / "wrong_shape"
    from engine.config import LoadConfig
    from engine.loader import load_model_source
    cfg = load_model_source(LoadConfig(model=str(path))).config
    write_adapter(wrong, cfg.replace(hidden_size=32), ("q_proj",), 4, 8, 3)
    with pytest.raises(LoRAError, match="do not fit"):
        tiny_llm(path, lora_modules={"w": str(wrong)})
    with pytest.raises(ConfigError, match="name"):
        tiny_llm(path, lora_modules={"bad name!": str(made["attn"][0])})


@pytest.mark.parametrize("max_loras", [0, 3])
def test_adapters_under_speculative_decoding(
        tiny_model_dirs: dict[str, Path],
        adapters: Callable[[str], dict[str, tuple[Path, dict, float]]], max_loras: int) -> None:
    """Verify steps carry adapter rows too (n-gram drafts): greedy output equals the same
    adapters' without speculation, request by request in one mixed batch — packed, and in
    slots (`max_loras`, the layout runtime loading writes into)."""
    from tests.unit.engine.test_spec_decode import PROMPTS as SPEC_PROMPTS

    made = adapters("llama")
    modules = {k: str(v[0]) for k, v in made.items()}
    names = [None, "attn", "all", "attn", None]
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3,
                                  "step_budget": False}):
        llm = tiny_llm(tiny_model_dirs["llama"], lora_modules=modules, speculative_config=spec,
                       max_loras=max_loras)
        for i, (prompt, name) in enumerate(zip(SPEC_PROMPTS, names, strict=True)):
            llm.engine.add_request(f"r{i}", prompt, greedy(30), lora_name=name)
        tokens: dict[str, list[int]] = {}
        while llm.engine.has_unfinished_requests():
            for o in llm.engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if spec is not None:
            assert llm.engine.scheduler.num_draft_tokens > 0
        outs.append(tokens)
        llm.shutdown()
    assert outs[0] == outs[1]
    assert outs[0]["r1"] != outs[0]["r0"]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_adapters_on_a_split_model(
        tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], PreTrainedModel],
        adapters: Callable[[str], dict[str, tuple[Path, dict, float]]], name: str) -> None:
    """Tensor parallelism (two ranks): each rank holds its share of every adapter (B's output
    slice where the projection splits its outputs, A's input slice where it splits its inputs
    and the all-reduce adds the partial deltas). Every position equals HF with the adapter
    merged, base and adapter rows in the same steps."""
    made = adapters(name)
    llm = tiny_llm(tiny_model_dirs[name], max_num_batched_tokens=6, tensor_parallel_size=2,
                   cpu_threads=1, lora_modules={k: str(v[0]) for k, v in made.items()})
    try:
        base = hf_reference(name)
        oracles = {"base": base, **{k: merged(base, w, s) for k, (_, w, s) in made.items()}}
        for rid, prompt in PROMPTS.items():
            llm.engine.add_request(rid, prompt, greedy(4),
                                   lora_name=None if rid == "base" else rid)
        for rid, tr in run_to_end(llm.engine).items():
            r = tr.request
            want = _hf_logits(oracles[rid], r.all_token_ids[:-1])[r.num_cached_tokens:]
            torch.testing.assert_close(tr.logits_matrix(r.num_cached_tokens), want,
                                       atol=ATOL, rtol=RTOL, msg=rid)
    finally:
        llm.shutdown()


def test_adapters_on_experts_are_refused_and_attention_ones_run(
        tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A mixture of experts (Qwen3-MoE: layer 0 sparse, layer 1 dense): an adapter on layer 0's
    MLP is refused by name; one on attention changes what the model generates."""
    from engine.config import LoadConfig
    from engine.loader import load_model_source
    from engine.lora.adapter import ATTENTION_TARGETS, load_adapter

    path = tiny_model_dirs["qwen3moe"]
    cfg = load_model_source(LoadConfig(model=str(path))).config
    write_adapter(tmp_path / "every", cfg, TARGETS, 4, 8, seed=3)
    with pytest.raises(LoRAError, match="layer 0's MLP is a mixture of experts"):
        load_adapter("every", str(tmp_path / "every"), cfg, 64)
    write_adapter(tmp_path / "attn", cfg, ATTENTION_TARGETS, 4, 8, seed=4)
    llm = tiny_llm(path, lora_modules={"attn": str(tmp_path / "attn")})
    prompt = [{"prompt_token_ids": [5, 17, 99, 3]}]
    base = llm.generate(prompt, greedy(6))[0].outputs[0].token_ids
    tuned = llm.generate(prompt, greedy(6), lora_request="attn")[0].outputs[0].token_ids
    assert base != tuned
