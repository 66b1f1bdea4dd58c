"""LoRA adapters loaded and unloaded while the engine runs (`max_loras` slots, vLLM's
`--max-loras` and `LLMEngine.add_lora` / `remove_lora`).

The oracle is the one of tests/unit/engine/test_lora.py: every computed position of a request under an
adapter equals `transformers` over the base weights with that adapter merged in (PEFT's
merge). Here the adapter arrives in a slot after the engine started, shares steps with base
rows and other slots' adapters, leaves its slot, and another takes it: what a request computes
depends only on its own adapter's files, whichever slot they were written to and whatever was
there before.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.config import ConfigError
from engine.llm import LLM
from engine.lora import LoRARequest
from engine_api.errors import EngineInputError
from tests.support.engine_driver import greedy, run_to_end, tiny_llm
from tests.unit.engine.test_lora import ATOL, PROMPTS, RTOL, _hf_logits, merged, write_test_adapters

Made = dict[str, tuple[Path, dict, float]]  # adapter name -> (directory, weights, scaling)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> Made:
    """tests/unit/engine/test_lora.py's "attn" and "all" adapters of the tiny Llama."""
    return write_test_adapters(tmp_path_factory.mktemp("lora_runtime"), tiny_model_dirs["llama"])


def _check_against_hf(llm: LLM, base: PreTrainedModel, made: Made,
                      runs: dict[str, tuple[list[int], str | None]]) -> dict[str, int]:
    """Run `runs` (request id -> prompt, adapter or None) in the same steps; every position
    must equal HF with the request's adapter merged. Returns each request's cached tokens."""
    for rid, (prompt, name) in runs.items():
        llm.engine.add_request(rid, prompt, greedy(4), lora_name=name)
    cached = {}
    for rid, tr in run_to_end(llm.engine).items():
        r = tr.request
        name = runs[rid][1]
        oracle = base if name is None else merged(base, made[name][1], made[name][2])
        want = _hf_logits(oracle, r.all_token_ids[:-1])[r.num_cached_tokens:]
        torch.testing.assert_close(tr.logits_matrix(r.num_cached_tokens), want,
                                   atol=ATOL, rtol=RTOL, msg=rid)
        cached[rid] = r.num_cached_tokens
    return cached


def test_load_unload_and_reuse_a_slot(tiny_model_dirs: dict[str, Path],
                                      hf_reference: Callable[[str], PreTrainedModel],
                                      made: Made) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], max_num_batched_tokens=6, max_loras=2)
    engine = llm.engine
    base = hf_reference("llama")
    assert engine.runtime_lora and engine.lora_names() == []
    # No adapter yet: base rows run through the (zero) slots and equal the base model.
    _check_against_hf(llm, base, made, {"b0": (PROMPTS["base"], None)})

    engine.add_lora("attn", str(made["attn"][0]))
    engine.add_lora("all", str(made["all"][0]))
    assert engine.lora_names() == ["attn", "all"]
    cached = _check_against_hf(llm, base, made, {
        "b1": (PROMPTS["attn"], None), "a1": (PROMPTS["attn"], "attn"),
        "l1": (PROMPTS["all"], "all")})
    assert cached["a1"] == 0  # the base model's blocks of the same prompt are not the adapter's

    # Unload "attn" (slot 1) and load "all"'s files under a new name there: the slot's old
    # columns are gone, and the new name's KV is not "all"'s (another root), nor "attn"'s.
    engine.remove_lora("attn")
    assert engine.lora_names() == ["all"]
    with pytest.raises(EngineInputError, match="unknown LoRA adapter 'attn'"):
        engine.add_request("gone", PROMPTS["attn"], greedy(2), lora_name="attn")
    engine.add_lora("all2", str(made["all"][0]))
    assert engine.runner.lora.slot("all2") == 1
    made2 = {**made, "all2": made["all"]}
    cached = _check_against_hf(llm, base, made2, {
        "n1": (PROMPTS["all"], "all2"), "l2": (PROMPTS["all"], "all")})
    assert cached["n1"] == 0 and cached["l2"] == 8  # "all"'s own blocks still serve it

    # "attn" again, into the slot "all2" leaves: equal to HF again, and its old blocks (same
    # files, so the same root) are prefix hits.
    engine.remove_lora("all2")
    engine.add_lora("attn", str(made["attn"][0]))
    cached = _check_against_hf(llm, base, made, {"a2": (PROMPTS["attn"], "attn")})
    assert cached["a2"] == 8
    llm.shutdown()


def test_refusals(tiny_model_dirs: dict[str, Path], made: Made,
                  tmp_path: Path) -> None:
    path = tiny_model_dirs["llama"]
    attn, every = str(made["attn"][0]), str(made["all"][0])
    llm = tiny_llm(path, lora_modules={"attn": attn}, max_loras=2, max_lora_rank=8)
    engine = llm.engine
    assert engine.lora_names() == ["attn"]
    with pytest.raises(EngineInputError, match="already been loaded"):
        engine.add_lora("attn", attn)
    with pytest.raises(EngineInputError, match="must be 1-128 characters"):
        engine.add_lora("bad name!", every)
    with pytest.raises(EngineInputError, match=r"no adapter_config\.json"):
        engine.add_lora("missing", str(tmp_path / "nowhere"))
    # An adapter of non-finite weights would turn every row of its steps into NaN (the other
    # slots' columns are multiplied by zero, and inf * 0 is NaN): refused.
    poisoned = tmp_path / "nan"
    shutil.copytree(every, poisoned)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(poisoned / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(poisoned / "adapter_model.safetensors"))
    with pytest.raises(EngineInputError, match="inf or NaN"):
        engine.add_lora("nan", str(poisoned))
    # Above the slots' rank: the engine's max_lora_rank refuses it by the file's field.
    big = tmp_path / "big"
    shutil.copytree(every, big)
    d = json.loads((big / "adapter_config.json").read_text()) | {"r": 16}
    (big / "adapter_config.json").write_text(json.dumps(d))
    with pytest.raises(EngineInputError, match="rank r=16"):
        engine.add_lora("big", str(big))
    engine.add_lora("all", every)
    with pytest.raises(EngineInputError, match="all 2 LoRA slots are taken"):
        engine.add_lora("third", every)
    # In use: an unfinished request holds its adapter's slot.
    engine.add_request("r", PROMPTS["all"], greedy(3), lora_name="all")
    assert engine.lora_requests() == {"attn": (0, 0), "all": (0, 1)}  # (running, waiting)
    engine.step()
    assert engine.lora_requests() == {"attn": (0, 0), "all": (1, 0)}
    with pytest.raises(EngineInputError, match="in use by 1 unfinished request"):
        engine.remove_lora("all")
    run_to_end(engine)
    engine.remove_lora("all")
    with pytest.raises(EngineInputError, match="no LoRA adapter 'all' is loaded"):
        engine.remove_lora("all")
    assert engine.lora_names() == ["attn"] and not engine.has_unfinished_requests()
    llm.shutdown()

    packed = tiny_llm(path, lora_modules={"attn": attn})  # no slots: fixed at start
    assert not packed.engine.runtime_lora
    with pytest.raises(EngineInputError, match="does not load LoRA adapters at runtime"):
        packed.engine.add_lora("all", every)
    packed.shutdown()
    with pytest.raises(ConfigError, match="2 LoRA modules given for max_loras 1"):
        tiny_llm(path, lora_modules={"attn": attn, "all": every}, max_loras=1)


def test_offline_loads_on_first_use(tiny_model_dirs: dict[str, Path], made: Made) -> None:
    """vLLM's offline pattern: `LLM(enable_lora=True)` and a `LoRARequest` with a path; the
    least recently used adapter makes room when the one slot is taken. Each request's tokens
    equal those of an engine with that adapter loaded at start."""
    path = tiny_model_dirs["llama"]
    prompt = [{"prompt_token_ids": PROMPTS["attn"]}]
    want = {}
    for name in ("attn", "all"):
        fixed = tiny_llm(path, lora_modules={name: str(made[name][0])})
        want[name] = fixed.generate(prompt, greedy(6), lora_request=name)[0].outputs[0].token_ids
        fixed.shutdown()
    assert want["attn"] != want["all"]

    llm = tiny_llm(path, enable_lora=True)
    assert llm.engine.runner.lora.max_loras == 1
    for name in ("attn", "all", "attn"):
        req = LoRARequest(name, 1, str(made[name][0]))
        got = llm.generate(prompt, greedy(6), lora_request=req)[0].outputs[0].token_ids
        assert got == want[name], name
        assert llm.engine.lora_names() == [name]
    with pytest.raises(EngineInputError, match="2 LoRA adapters in one call, but the engine h"):
        llm.generate(prompt * 2, greedy(2), lora_request=[
            LoRARequest(n, 1, str(made[n][0])) for n in ("attn", "all")])
    llm.shutdown()


def test_slots_on_a_split_model(tiny_model_dirs: dict[str, Path],
                                hf_reference: Callable[[str], PreTrainedModel],
                                made: Made) -> None:
    """Tensor parallelism, two ranks: the slotted layout splits like the packed one (each rank
    its share of every slot). A start-time adapter, one loaded at runtime (every rank reads its
    share into the same slot) and, after an unload, another in that slot all equal HF."""
    llm = tiny_llm(tiny_model_dirs["llama"], max_num_batched_tokens=6, tensor_parallel_size=2,
                   cpu_threads=1, max_loras=2, lora_modules={"attn": str(made["attn"][0])})
    try:
        base = hf_reference("llama")
        engine = llm.engine
        assert engine.runtime_lora
        engine.add_lora("all", str(made["all"][0]))
        _check_against_hf(llm, base, made, {
            "b": (PROMPTS["base"], None), "a": (PROMPTS["attn"], "attn"),
            "l": (PROMPTS["all"], "all")})
        with pytest.raises(EngineInputError, match="all 2 LoRA slots are taken"):
            engine.add_lora("third", str(made["all"][0]))
        engine.remove_lora("attn")
        engine.add_lora("all2", str(made["all"][0]))  # into attn's slot, on every rank
        assert engine.runner.lora.slot("all2") == 1
        _check_against_hf(llm, base, {**made, "all2": made["all"]},
                          {"n": (PROMPTS["attn"], "all2")})
        engine.remove_lora("all2")
        with pytest.raises(EngineInputError, match="no adapter_config"):  # rank 0 checks first
            engine.add_lora("missing", str(made["all"][0].parent / "nowhere"))
        engine.add_lora("attn", str(made["attn"][0]))  # the ranks stayed in step
        assert engine.lora_names() == ["attn", "all"]
        _check_against_hf(llm, base, made, {"a2": (PROMPTS["base"], "attn")})
    finally:
        llm.shutdown()
