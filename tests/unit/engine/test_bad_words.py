"""`SamplingParams.bad_words` (engine/bad_words.py): the words' token sequences from the real
SmolLM2 tokenizer, which token a request's output tail bans, and SmolLM2 generating around a
banned word (greedy: the same output up to where the word began, never the word's tokens)."""

from __future__ import annotations

import pytest

from engine.bad_words import bad_words_token_ids, banned_tokens
from engine.llm import LLM
from engine.loader.load import default_model_path
from engine.request import Request
from engine_api.errors import EngineInputError
from engine_api.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs
from engine_api.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(default_model_path())


def _encode(tok: Tokenizer):  # type: ignore[no-untyped-def]
    return lambda text: tok.encode(text, add_special_tokens=False)


def test_sequences_cover_the_word_alone_and_after_a_space(tok: Tokenizer) -> None:
    encode = _encode(tok)
    seqs = bad_words_token_ids(["Paris", "  hello world"], encode)
    assert tuple(encode("Paris")) in seqs and tuple(encode(" Paris")) in seqs
    assert tuple(encode("hello world")) in seqs  # leading spaces dropped
    assert all(seqs)
    assert len(set(seqs)) == len(seqs)


def test_banned_token_follows_the_output_tail() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), output_token_ids=[9, 4, 5])
    req.bad_words_token_ids = ((7,), (4, 5, 6), (5, 8), (9, 9, 1))
    assert banned_tokens(req) == [7, 6, 8]  # (9, 9) is not the tail: 1 stays allowed
    req.output_token_ids = []
    assert banned_tokens(req) == [7]  # longer words cannot complete yet


def test_bad_words_are_validated() -> None:
    for words in (["ok", ""], ["  "], "word", ["x" * 257], ["w"] * 129):
        with pytest.raises(SamplingParamsError, match="bad_words"):
            SamplingParams(bad_words=words)  # type: ignore[arg-type]
    # Combinations that could leave a row no token to sample are refused.
    with pytest.raises(SamplingParamsError, match="bad_words cannot be combined"):
        SamplingParams(bad_words=["x"], allowed_token_ids=[3, 4])
    with pytest.raises(SamplingParamsError, match="bad_words cannot be combined"):
        SamplingParams(bad_words=["Paris"],
                       structured_outputs=StructuredOutputs(choice=("Paris", "Rome")))


@pytest.mark.slow
def test_generation_avoids_a_banned_word(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    prompt = {"prompt_token_ids": tok.encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")}
    free = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
    ids = free.outputs[0].token_ids
    assert "Paris" in free.outputs[0].text  # the word this test bans
    banned = SamplingParams(temperature=0, max_tokens=24, bad_words=["Paris"])
    out = smollm2.generate(prompt, banned)[0].outputs[0]
    seqs = bad_words_token_ids(["Paris"], _encode(tok))
    got = list(out.token_ids)
    for seq in seqs:
        n = len(seq)
        assert all(tuple(got[i:i + n]) != seq for i in range(len(got) - n + 1)), (seq, got)
    # Greedy: the same tokens until the first place a banned sequence would have completed.
    first = min(i + len(seq) - 1 for seq in seqs for i in range(len(ids) - len(seq) + 1)
                if tuple(ids[i:i + len(seq)]) == seq)
    assert got[:first] == list(ids[:first]) and got[first] != ids[first]


def test_engine_without_tokenizer_refuses_bad_words(tiny_model_dirs) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(EngineInputError, match="tokenizer"):
        llm.generate({"prompt_token_ids": [3, 4, 5]},
                     SamplingParams(max_tokens=2, bad_words=["x"]))
    llm.shutdown()
