"""Tensor parallelism on the CPU: two ranks (this process and a worker process, Gloo) hold half
of each model's heads and MLP columns each, and the engine computes what one process does.

Every position's logits against Hugging Face `transformers` (each architecture: GQA, Llama 3
RoPE scaling, QKV bias, Qwen3's q/k norms, Phi-3's fused checkpoint), through chunked prefill,
the prefix cache and preemption; KV blocks leave and enter a split cache whole (every KV head,
the layout one process uses); a quantized cache's calibration sees every rank's heads; what
cannot split is refused by name; a dead worker fails the next step instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.config import ConfigError, ModelConfig, ParallelConfig
from engine.llm import LLM
from engine.parallel.protocol import HEADER_FIELDS, Op, pack, unpack
from engine.parallel.shard import TensorShard, shard_model_config, shard_weight
from engine.runner.tp_driver import WorkerFailed
from engine_api.sampling_params import SamplingParams
from tests.support.engine_driver import drive, greedy, run_to_end, tiny_llm
from tests.support.tiny_models import TINY_MODELS
from tests.unit.engine.test_spec_decode import PROMPTS as SPEC_PROMPTS

ATOL = RTOL = 1e-4
NUM_DECODE = 5
PROMPTS = {"a": [5, 17, 99, 3, 250, 7, 42, 8, 300, 11, 64, 1, 200],
           "b": [9, 8, 7, 6, 5, 4, 383]}


def tp_llm(path: Path, size: int = 2, **kwargs: object) -> LLM:
    return tiny_llm(path, tensor_parallel_size=size, cpu_threads=1, **kwargs)


def _hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_two_ranks_match_hf_every_position(tiny_model_dirs: dict[str, Path],
                                           hf_reference: Callable[[str], PreTrainedModel],
                                           name: str) -> None:
    """Chunked prefill (5-token budget: the 13-token prompt takes three chunks), decodes beside
    a prefill, then a prefix-cache hit: every computed row's logits equal HF's."""
    llm = tp_llm(tiny_model_dirs[name], max_num_batched_tokens=5)
    try:
        assert llm.engine.runner.shard_config.num_attention_heads == 2
        ref = hf_reference(name)
        for rid, prompt in PROMPTS.items():
            llm.engine.add_request(rid, prompt, greedy(NUM_DECODE))
        traces = run_to_end(llm.engine)
        shared = [*PROMPTS["a"][:12], 77, 78]
        req = llm.engine.add_request("c", shared, greedy(NUM_DECODE))
        traces.update(run_to_end(llm.engine))
        assert req.num_cached_tokens == 12
        for rid, tr in traces.items():
            r = tr.request
            start = r.num_cached_tokens
            ours = tr.logits_matrix(start)
            expected = _hf_logits(ref, r.all_token_ids[:-1])[start:]
            torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL, msg=rid)
            p = r.num_prompt_tokens
            assert r.output_token_ids == expected[p - 1 - start:].argmax(-1).tolist()
    finally:
        llm.shutdown()


def test_generate_under_preemption_equals_one_process(tiny_model_dirs: dict[str, Path]) -> None:
    """Few KV blocks: requests are preempted and recomputed; sampled tokens (greedy and seeded)
    equal the one-process engine's."""
    path = tiny_model_dirs["llama"]
    prompts = [{"prompt_token_ids": [i + 1, 40 + i, 7, 9, 100 + 3 * i, 11]} for i in range(6)]
    params = [greedy(12)] + [SamplingParams(temperature=0.8, seed=i, max_tokens=12,
                                            ignore_eos=True) for i in range(5)]
    one = tiny_llm(path, num_gpu_blocks=14, max_num_seqs=6)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    one.shutdown()
    two = tp_llm(path, num_gpu_blocks=14, max_num_seqs=6)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
        assert two.engine.scheduler.num_preemptions > 0
        two.engine.kv.check_integrity()
    finally:
        two.shutdown()
    assert got == want


def test_kv_blocks_leave_and_enter_whole(tiny_model_dirs: dict[str, Path]) -> None:
    """`read_blocks` of a split cache holds every KV head in the model's order — what one
    process's cache holds for the same prompt — and `write_blocks` puts each rank's heads back."""
    path = tiny_model_dirs["llama3"]
    prompt = list(range(3, 20))  # 17 tokens: 4 full blocks of 4
    one, two = tiny_llm(path), tp_llm(path)
    try:
        blocks = []
        for llm in (one, two):
            llm.engine.add_request("p", prompt, greedy(3))
            next(drive(llm.engine))  # the prompt's step: its KV is in the cache
            ids = llm.engine.kv.block_ids("p")[:4]
            blocks.append((ids, llm.engine.runner.read_blocks(ids)))
        (_, kv_one), (ids_two, kv_two) = blocks
        assert kv_two.shape == kv_one.shape == (4, *one.engine.runner.kv_shape_per_block)
        torch.testing.assert_close(kv_two, kv_one, atol=ATOL, rtol=RTOL)
        # Whole blocks: one fingerprint for both sizes, so their workers exchange KV.
        assert one.engine.fingerprint == two.engine.fingerprint
        # Written into other blocks of the split cache, they read back bit for bit.
        free = [b for b in range(two.engine.runner.result.num_blocks)
                if b not in two.engine.kv.block_ids("p")][:4]
        marked = kv_one.clone()
        marked[..., -1, :] += 1.0  # the last KV head: rank 1's share
        two.engine.runner.write_blocks(free, marked)
        torch.testing.assert_close(two.engine.runner.read_blocks(free), marked, atol=0, rtol=0)
        assert not torch.equal(two.engine.runner.read_blocks(ids_two), marked)
    finally:
        two.shutdown()
        one.shutdown()


def test_int8_cache_calibrates_over_every_rank(tiny_model_dirs: dict[str, Path]) -> None:
    """An int8 cache's scales and channel factors come from one calibration pass whose
    per-channel |K|, |V| maxima are gathered from every rank's heads: the same scales and
    factors one process calibrates, each rank applying its own heads' factors (rank 0's
    checked here; the others' by the same tokens)."""
    path = tiny_model_dirs["qwen2"]
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 7, 42, 8]}]
    one = tiny_llm(path, kv_cache_dtype="int8")
    want = one.engine.runner.kv_scales.clone()
    want_factors = one.engine.runner.kv_channel_factors
    assert want_factors is not None and float(want_factors.min()) < 1.0
    tokens = one.generate(prompts, greedy(8))[0].outputs[0].token_ids
    one.shutdown()
    two = tp_llm(path, kv_cache_dtype="int8")
    try:
        runner = two.engine.runner
        torch.testing.assert_close(runner.kv_scales, want, atol=1e-5, rtol=1e-4)
        assert runner.kv_channel_factors is not None
        assert torch.equal(runner.kv_channel_factors, want_factors)
        hkv = want_factors.shape[2] // 2  # rank 0's KV heads: the first half
        for i, attn in enumerate(runner.model.attention_layers()):
            assert attn.kv_channels is not None
            assert torch.equal(attn.kv_channels.o_mul[:1], want_factors[i, 1, :1])
            assert attn.kv_channels.k_mul.shape[0] == hkv
        assert two.generate(prompts, greedy(8))[0].outputs[0].token_ids == tokens
    finally:
        two.shutdown()


def test_what_does_not_split_is_refused_by_name(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ConfigError, match="num_attention_heads"):
        tp_llm(path, size=3)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        shard_model_config(ModelConfig(num_attention_heads=8, num_key_value_heads=2,
                                       intermediate_size=64), 4)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0).validate()
    # The process can still start a tensor-parallel engine after those refusals.
    llm = tp_llm(path)
    llm.shutdown()


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "step_budget": False},
    {"model": "SELF", "num_speculative_tokens": 3, "step_budget": False}],
                         ids=["ngram", "draft_model"])
def test_speculative_decoding_verifies_on_the_split_model(
        tiny_model_dirs: dict[str, Path], spec: dict[str, object]) -> None:
    """Verify steps (several rows per sequence) run on both ranks; a draft model runs whole
    beside rank 0's shard. Greedy output equals the one-process engine's without drafts."""
    path = tiny_model_dirs["llama"]
    if spec.get("model") == "SELF":  # the target drafting for itself: every draft accepted
        spec = {**spec, "model": str(path)}
    # test_spec_decode's prompts: loops the n-gram proposer finds in this model's output.
    prompts = [{"prompt_token_ids": p} for p in SPEC_PROMPTS]
    one = tiny_llm(path)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy(20))]
    one.shutdown()
    two = tp_llm(path, speculative_config=spec)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, greedy(20))]
        sched = two.engine.scheduler
        assert sched.num_draft_tokens > 0  # verify steps ran on both ranks
        if "model" in spec:
            assert sched.num_accepted_tokens == sched.num_draft_tokens
    finally:
        two.shutdown()
    assert got == want


def test_a_dead_worker_fails_the_next_step_instead_of_hanging(
        tiny_model_dirs: dict[str, Path]) -> None:
    llm = tp_llm(tiny_model_dirs["llama"])
    try:
        driver = llm.engine.runner.tp
        assert driver is not None
        worker = driver._procs[0]
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        with pytest.raises(WorkerFailed, match="rank 1 exited"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2))
    finally:
        llm.shutdown()
    # Its group is gone with it: a new engine starts.
    tp_llm(tiny_model_dirs["llama"]).shutdown()


def _part(name: str, tensor: torch.Tensor, full: ModelConfig, shard: TensorShard
          ) -> torch.Tensor:
    part = shard_weight(name, tensor, full, shard)
    assert part is not None
    return part


def test_shard_weights_and_commands() -> None:
    """The slicing rules on named tensors (column, row, row bias, Phi-3's fused projections),
    and the command header's round trip and refusals."""
    full = ModelConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                       hidden_size=8, intermediate_size=6)
    r1 = TensorShard(1, 2)
    w = torch.arange(8 * 8).view(8, 8)
    assert torch.equal(_part("layers.0.self_attn.q_proj.weight", w, full, r1), w[4:])
    assert torch.equal(_part("layers.0.self_attn.o_proj.weight", w, full, r1), w[:, 4:])
    assert shard_weight("layers.0.mlp.down_proj.bias", w[0], full, r1) is None
    assert torch.equal(_part("layers.0.mlp.down_proj.bias", w[0], full, TensorShard(0, 2)),
                       w[0])
    assert torch.equal(_part("norm.weight", w[0], full, r1), w[0])
    qkv = torch.arange(16)[:, None]  # q rows 0..7, k 8..11, v 12..15
    assert _part("layers.0.self_attn.qkv_proj.weight", qkv, full, r1).flatten().tolist() \
        == [4, 5, 6, 7, 10, 11, 14, 15]
    gate_up = torch.arange(12)[:, None]
    assert _part("layers.0.mlp.gate_up_proj.weight", gate_up, full, r1).flatten().tolist() \
        == [3, 4, 5, 9, 10, 11]
    header = pack(Op.ALLOCATE_KV, [123])
    assert unpack(header) == (Op.ALLOCATE_KV, [123] + [0] * (HEADER_FIELDS - 2))
    with pytest.raises(ValueError, match="bytes"):
        unpack(header[:-1])
    with pytest.raises(ValueError):
        unpack(pack(Op.SHUTDOWN)[:0] + (99).to_bytes(8, "little") + header[8:])


def test_a_worker_dead_before_joining_fails_the_start_at_once(
        tiny_model_dirs: dict[str, Path]) -> None:
    """Rank 1 killed as soon as it exists (before it could import the engine and join): the
    start fails in seconds, naming the rank, not after the rendezvous's 300 s timeout, and
    the process can start another tensor-parallel engine."""
    from tests.e2e.test_up import _spawned_children

    me = str(os.getpid())
    before = set(_spawned_children(me))
    killed: list[str] = []

    def kill_the_new_worker() -> None:
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for pid in set(_spawned_children(me)) - before:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.002)

    killer = threading.Thread(target=kill_the_new_worker)
    killer.start()
    start = time.monotonic()
    with pytest.raises(ConfigError, match="rank 1 failed before joining the group: exited"):
        tp_llm(tiny_model_dirs["llama"])
    killer.join()
    assert killed and time.monotonic() - start < 60
    tp_llm(tiny_model_dirs["llama"]).shutdown()


def test_a_failure_after_the_workers_started_takes_them_down(
        tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """An error raised once the ranks are up stops the workers and leaves the group, so the
    next tensor-parallel engine of this process starts: a LoRA adapter that is not there (read
    by every rank after its shard: a worker reports it first), and an error of rank 0's own
    after the workers are ready (an int8 cache's scales file that is not there: rank 0 reads
    it, then sends the scales)."""
    path = tiny_model_dirs["llama"]
    with pytest.raises(ConfigError, match=r"rank 1 failed: LoRAError: .*no adapter_config"):
        tp_llm(path, lora_modules={"gone": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="nope"):
        tp_llm(path, kv_cache_dtype="int8", kv_scales=str(tmp_path / "nope.json"))
    tp_llm(path).shutdown()
