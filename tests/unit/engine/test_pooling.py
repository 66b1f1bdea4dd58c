"""Embeddings (`LLM.embed`, `PoolingParams`): LAST / MEAN / CLS pooling checked against
`transformers`' final hidden states (the final norm's output) on the same weights — in one batch
of prompts of different lengths, over prefill chunks, under async scheduling, with the prefix
cache holding the prompt, after a preemption, beside generation requests and in the prefill
role — plus normalization, Matryoshka `dimensions`, validation, and the default pooling read
from a model's sentence-transformers files.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.cli_args import add_engine_args, engine_config_from_args
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoadConfig,
    PoolerConfig,
    RunnerConfig,
    SchedulerConfig,
)
from engine.llm import LLM
from engine.outputs import EmbeddingRequestOutput
from engine.pooler import resolve_pooler, sentence_transformers_pooler
from engine_api.errors import EngineInputError
from engine_api.pooling_params import PoolingParams, PoolingParamsError
from engine_api.request_options import RemoteKv
from tests.support.engine_driver import greedy, run_steps, step_tokens, tiny_llm

PROMPTS = [[(11 * j + 5) % 380 + 2 for j in range(37)], [(13 * j + 1) % 380 + 2 for j in range(21)],
           [7, 300, 12, 99, 5], [42]]
KINDS = ("LAST", "MEAN", "CLS")
TOL = dict(atol=2e-5, rtol=1e-5)

Reference = Callable[[list[int], str], torch.Tensor]


def _hidden(hf: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[P, hidden] float32: transformers' final hidden states (after the final norm)."""
    with torch.no_grad():
        return hf.model(torch.tensor([prompt])).last_hidden_state[0].float()


def _pooled(hf: PreTrainedModel) -> Reference:
    def pooled(prompt: list[int], kind: str) -> torch.Tensor:
        h = _hidden(hf, prompt)
        return {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return pooled


def _ids(*prompts: list[int]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def _vec(out: EmbeddingRequestOutput) -> torch.Tensor:
    assert out.finished
    return torch.tensor(out.outputs.embedding)


def _raw(kind: str, **kw: object) -> PoolingParams:
    return PoolingParams(pooling_type=kind, normalize=False, **kw)  # type: ignore[arg-type]


def _all_free(llm: LLM) -> None:
    eng = llm.engine
    eng.scheduler.check_integrity()
    assert not eng.kv.req_to_blocks and not eng.scheduler.leases
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.fixture(scope="module")
def ref_llama(hf_reference: Callable[[str], PreTrainedModel]) -> Reference:
    return _pooled(hf_reference("llama"))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_each_pooling_equals_transformers_final_hidden_states(
        name: str, tiny_model_dirs: dict[str, Path],
        hf_reference: Callable[[str], PreTrainedModel]) -> None:
    ref = _pooled(hf_reference(name))
    llm = tiny_llm(tiny_model_dirs[name])
    for kind in KINDS:  # one batch of four prompts of different lengths each time
        outs = llm.embed(_ids(*PROMPTS), _raw(kind))
        assert [o.prompt_token_ids for o in outs] == PROMPTS
        for out, prompt in zip(outs, PROMPTS, strict=True):
            assert out.outputs.hidden_size == 64
            torch.testing.assert_close(_vec(out), ref(prompt, kind), **TOL, msg=kind)
    _all_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_pools_every_chunk(tiny_model_dirs: dict[str, Path], ref_llama: Reference,
                                           async_scheduling: bool) -> None:
    # 8-token steps: the 37-token prompt over five chunks, the others beside and after it.
    llm = tiny_llm(tiny_model_dirs["llama"], max_num_batched_tokens=8,
                   async_scheduling=async_scheduling)
    for kind in KINDS:
        outs = llm.embed(_ids(*PROMPTS), _raw(kind))
        for out, prompt in zip(outs, PROMPTS, strict=True):
            torch.testing.assert_close(_vec(out), ref_llama(prompt, kind), **TOL, msg=kind)
    _all_free(llm)


def test_normalize_and_matryoshka_dimensions(tiny_model_dirs: dict[str, Path],
                                             ref_llama: Reference) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"])
    prompt = PROMPTS[0]
    want = ref_llama(prompt, "LAST")
    default, = llm.embed(_ids(prompt))  # the model's default: LAST, normalized
    torch.testing.assert_close(_vec(default), torch.nn.functional.normalize(want, dim=0), **TOL)
    assert _vec(default).norm().item() == pytest.approx(1.0, abs=1e-5)
    cut, raw_cut = llm.embed(_ids(prompt, prompt), [PoolingParams(dimensions=16),
                                                   _raw("LAST", dimensions=16)])
    # Truncated first, then renormalized (Matryoshka): not the full vector's first 16.
    torch.testing.assert_close(_vec(cut), torch.nn.functional.normalize(want[:16], dim=0), **TOL)
    torch.testing.assert_close(_vec(raw_cut), want[:16], **TOL)
    full, = llm.embed(_ids(prompt), PoolingParams(dimensions=64))
    torch.testing.assert_close(_vec(full), _vec(default), **TOL)


def test_prefix_cache_serves_last_but_not_mean_or_cls(tiny_model_dirs: dict[str, Path],
                                                       ref_llama: Reference) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"])
    prompt = PROMPTS[0]  # 37 tokens: 9 full blocks of 4
    first, = llm.embed(_ids(prompt), _raw("LAST"))
    assert first.num_cached_tokens == 0
    # The embedding's blocks stayed in the cache: LAST takes the hit, and pools the same.
    again, = llm.embed(_ids(prompt), _raw("LAST"))
    assert again.num_cached_tokens == 36
    torch.testing.assert_close(_vec(again), _vec(first), **TOL)
    # MEAN and CLS need positions a hit would skip: they compute the prompt all the same.
    for kind in ("MEAN", "CLS"):
        out, = llm.embed(_ids(prompt), _raw(kind))
        assert out.num_cached_tokens == 0
        torch.testing.assert_close(_vec(out), ref_llama(prompt, kind), **TOL, msg=kind)
    # ... and a generation after them finds the prompt cached.
    gen = llm.generate(_ids(prompt), greedy(2))[0]
    assert gen.num_cached_tokens == 36
    _all_free(llm)


def test_mean_survives_a_preemption(tiny_model_dirs: dict[str, Path], ref_llama: Reference) -> None:
    # 14 blocks of 4 tokens: the two long prompts cannot both be held while a generation
    # grows beside them, so an embedding is preempted mid-prompt and recomputed (pooled once).
    llm = tiny_llm(tiny_model_dirs["llama"], num_gpu_blocks=14, max_num_batched_tokens=16,
                   enable_prefix_caching=False)
    eng = llm.engine
    second = [*PROMPTS[0][1:], 7]
    eng.add_request("gen", PROMPTS[1], greedy(20))
    embeds = {rid: (eng.add_request(rid, prompt, _raw("MEAN")), prompt)
              for rid, prompt in (("a", PROMPTS[0]), ("b", second))}
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert sum(req.num_preemptions for req, _ in embeds.values()) > 0
    for rid, (_, prompt) in embeds.items():
        final = finals[rid]
        assert final.new_token_ids == [] and final.embedding is not None
        torch.testing.assert_close(torch.tensor(final.embedding), ref_llama(prompt, "MEAN"),
                                   **TOL, msg=rid)
    _all_free(llm)


def test_embeddings_beside_generation_change_nothing(tiny_model_dirs: dict[str, Path],
                                                      ref_llama: Reference) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], max_num_batched_tokens=16, async_scheduling=True)
    alone = step_tokens(run_steps(llm, [PROMPTS[1]], [greedy(6)])[0])["r0"]
    outs, _ = run_steps(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                        [_raw("MEAN"), greedy(6), _raw("LAST")])  # type: ignore[list-item]
    assert step_tokens(outs)["r1"] == alone
    for rid, prompt, kind in (("r0", PROMPTS[0], "MEAN"), ("r2", PROMPTS[2], "LAST")):
        final = outs[rid][-1]
        assert final.finished and final.embedding is not None
        assert final.finish_reason is None and not final.kv_held
        torch.testing.assert_close(torch.tensor(final.embedding), ref_llama(prompt, kind),
                                   **TOL, msg=rid)
    _all_free(llm)


def test_prefill_role_embeds_without_a_lease(tiny_model_dirs: dict[str, Path],
                                             ref_llama: Reference) -> None:
    llm = LLM.from_config(EngineConfig(
        load=LoadConfig(model=str(tiny_model_dirs["llama"]), dtype="float32"),
        cache=CacheConfig(block_size=4, num_gpu_blocks=64),
        scheduler=SchedulerConfig(role="prefill"), runner=RunnerConfig(device="cpu")))
    out, = llm.embed(_ids(PROMPTS[1]), _raw("CLS"))
    torch.testing.assert_close(_vec(out), ref_llama(PROMPTS[1], "CLS"), **TOL)
    _all_free(llm)


def test_bad_pooling_requests_are_refused(tiny_model_dirs: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], max_model_len=40)
    eng = llm.engine
    with pytest.raises(PoolingParamsError, match="dimensions must be an integer >= 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(PoolingParamsError, match="pooling_type must be one of LAST, MEAN, CLS"):
        PoolingParams(pooling_type="MAX")  # type: ignore[arg-type]
    with pytest.raises(EngineInputError, match=r"dimensions must be at most 64"):
        llm.embed(_ids(PROMPTS[2]), PoolingParams(dimensions=65))
    with pytest.raises(EngineInputError, match="prompt has 41 tokens; max_model_len is 40"):
        llm.embed(_ids(list(range(2, 43))))
    with pytest.raises(EngineInputError, match="outside"):
        llm.embed(_ids([1, 384]))
    with pytest.raises(EngineInputError, match="no remote KV"):
        eng.add_request("x", PROMPTS[2], PoolingParams(), remote_kv=RemoteKv(5))
    # A whole-context prompt is fine: an embedding generates nothing after it.
    out, = llm.embed(_ids(list(range(2, 42))))
    assert len(out.outputs.embedding) == 64
    _all_free(llm)


# ---- the default pooling: the engine's override, the model's sentence-transformers files ------

def _write_st(path: Path, mode: str | None, normalize: bool) -> Path:
    """sentence-transformers files in `path`: a Pooling module with `mode` set (None: no
    Pooling module) and, with `normalize`, a Normalize module."""
    modules: list[dict[str, object]] = [{"idx": 0, "name": "0", "path": "",
                                         "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
        flags = {f"pooling_mode_{m}": m == mode for m in (
            "cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
            "weightedmean_tokens", "lasttoken")}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, **flags, "include_prompt": True}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    path.mkdir(parents=True, exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    return path


@pytest.mark.parametrize(("mode", "normalize", "want"), [
    ("lasttoken", True, PoolerConfig("LAST", True)),
    ("mean_tokens", False, PoolerConfig("MEAN", False)),
    ("cls_token", True, PoolerConfig("CLS", True)),
    (None, True, PoolerConfig(None, True)),
])
def test_sentence_transformers_files_name_the_pooling(tmp_path: Path, mode: str | None,
                                                      normalize: bool, want: PoolerConfig) -> None:
    assert sentence_transformers_pooler(_write_st(tmp_path, mode, normalize)) == want


def test_default_pooler_resolution(tmp_path: Path) -> None:
    st = _write_st(tmp_path / "st", "mean_tokens", normalize=False)
    assert resolve_pooler(PoolerConfig(), str(st)) == PoolerConfig("MEAN", False)
    assert resolve_pooler(PoolerConfig("CLS"), str(st)) == PoolerConfig("CLS", False)
    # No sentence-transformers files (a plain directory, a GGUF file, dummy weights): LAST,
    # normalized, as vLLM serves decoder embedding models.
    (tmp_path / "plain").mkdir()
    for model in (str(tmp_path / "plain"), "", "dummy:llama-3.1-8b"):
        assert resolve_pooler(PoolerConfig(), model) == PoolerConfig("LAST", True)
    maxed = _write_st(tmp_path / "max", "max_tokens", normalize=True)
    with pytest.raises(ConfigError, match=r"pooling_mode_max_tokens.*--pooling-type"):
        resolve_pooler(PoolerConfig(), str(maxed))
    assert resolve_pooler(PoolerConfig("LAST"), str(maxed)) == PoolerConfig("LAST", True)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "modules.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read sentence-transformers"):
        resolve_pooler(PoolerConfig(), str(tmp_path / "bad"))


def test_engine_pools_as_the_model_directory_says(tiny_model_dirs: dict[str, Path],
                                                  ref_llama: Reference, tmp_path: Path) -> None:
    model = tmp_path / "st_llama"
    shutil.copytree(tiny_model_dirs["llama"], model)
    _write_st(model, "mean_tokens", normalize=False)
    llm = tiny_llm(model)
    assert llm.engine.pooler == PoolerConfig("MEAN", False)
    out, = llm.embed(_ids(PROMPTS[1]))
    torch.testing.assert_close(_vec(out), ref_llama(PROMPTS[1], "MEAN"), **TOL)
    # The engine's own option wins (as `--pooling-type`).
    cls = tiny_llm(model, pooling_type="CLS")
    out, = cls.embed(_ids(PROMPTS[1]))
    torch.testing.assert_close(_vec(out), ref_llama(PROMPTS[1], "CLS"), **TOL)


def test_pooling_type_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).pooler == PoolerConfig()
    config = engine_config_from_args(parser.parse_args(["--pooling-type", "MEAN"]))
    assert config.pooler == PoolerConfig("MEAN")
    with pytest.raises(SystemExit):
        parser.parse_args(["--pooling-type", "MAX"])
