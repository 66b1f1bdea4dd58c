"""Decode steps as two micro-batches (engine/model/overlap.py): on the CPU the halves run one
after the other, so the split itself (metadata halves, residual stream, the join) must give what
the whole batch gives: the same greedy tokens and logprobs from the tiny float32 Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.forward_context import AttentionMetadata, split_decode_metadata
from engine.config import ConfigError
from engine.runner.model_build import check_decode_overlap
from tests.support.engine_driver import tiny_llm

PROMPTS = [[(11 * i + 5 * j) % 300 + 1 for j in range(n)] for i, n in enumerate([3, 17, 8, 30, 5])]


def _generate(llm: LLM, max_tokens: list[int]) -> list[tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        result.append((c.token_ids, [lp.logprob for lp in c.logprobs]))
    return result


@pytest.mark.parametrize("min_batch", [2, 4])
def test_overlapped_decode_matches_whole_batch(tiny_model_dirs: dict[str, Path],
                                               min_batch: int) -> None:
    path = tiny_model_dirs["llama"]
    # Different lengths: the batch shrinks 5 -> 1 (odd halves, then below the threshold).
    max_tokens = [9, 14, 4, 11, 6]
    whole = tiny_llm(path)
    want = _generate(whole, max_tokens)
    assert whole.engine.runner.num_overlapped_steps == 0
    split = tiny_llm(path, decode_overlap_min_batch=min_batch)
    got = _generate(split, max_tokens)
    runner = split.engine.runner
    assert runner.num_overlapped_steps >= 3, "the overlapped path was never taken"
    assert len({t for toks, _ in want for t in toks}) > 8, "outputs look degenerate"
    for (want_toks, want_lps), (got_toks, got_lps) in zip(want, got, strict=True):
        assert got_toks == want_toks
        torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(want_lps),
                                   rtol=1e-4, atol=1e-4)
    assert split.engine.kv.num_free_blocks == split.engine.kv.num_blocks


def _decode_md(seq_lens: list[int]) -> AttentionMetadata:
    b = len(seq_lens)
    return AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(b * 3, dtype=torch.int32).view(b, 3),
        slot_mapping=torch.tensor([10 * i + 1 for i in range(b)]), num_decodes=b,
        max_query_len=1, max_seq_len=max(seq_lens), query_start_loc_cpu=list(range(b + 1)),
        seq_lens_cpu=list(seq_lens))


def test_split_decode_metadata_halves() -> None:
    md = _decode_md([5, 9, 2, 7, 4])
    a, b = split_decode_metadata(md, 2)
    assert a.seq_lens.tolist() == [5, 9] and b.seq_lens.tolist() == [2, 7, 4]
    assert a.seq_lens_cpu == [5, 9] and b.seq_lens_cpu == [2, 7, 4]
    assert torch.equal(b.block_tables, md.block_tables[2:])
    assert b.slot_mapping.tolist() == [21, 31, 41]
    # Each half's query offsets start at 0.
    assert a.query_start_loc.tolist() == [0, 1, 2] and b.query_start_loc.tolist() == [0, 1, 2, 3]
    assert b.query_start_loc_cpu == [0, 1, 2, 3]
    assert (a.num_decodes, b.num_decodes) == (2, 3)
    # Views, not copies: the CUDA-graph buffers behind them are refilled before each replay.
    assert b.seq_lens.data_ptr() == md.seq_lens[2:].data_ptr()


def test_split_decode_metadata_rejects_prefills_and_bad_splits() -> None:
    md = _decode_md([5, 9, 2])
    with pytest.raises(ValueError, match="split must be"):
        split_decode_metadata(md, 0)
    with pytest.raises(ValueError, match="split must be"):
        split_decode_metadata(md, 3)
    md.num_decodes = 2
    with pytest.raises(ValueError, match="single-token decodes"):
        split_decode_metadata(md, 1)


def test_overlap_threshold_is_validated(tiny_model_dirs: dict[str, Path]) -> None:
    assert check_decode_overlap(0) == 0 and check_decode_overlap(64) == 64
    for bad in (-1, 1):
        with pytest.raises(ConfigError, match="decode_overlap_min_batch"):
            check_decode_overlap(bad)
    with pytest.raises(ConfigError, match="decode_overlap_min_batch"):
        tiny_llm(tiny_model_dirs["llama"], decode_overlap_min_batch=1)
    assert tiny_llm(tiny_model_dirs["llama"]).engine.runner.micro_batches is None  # off by default
