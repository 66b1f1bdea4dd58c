"""Sequence classification and cross-encoder scoring (engine/classifier.py, `LLM.classify`,
`LLM.score`):

- a `Qwen3ForSequenceClassification` checkpoint against `transformers`' own class on the same
  weights: every prompt's logits, in one batch of different lengths, chunked;
- `classifier_from_token` on the real SmolLM2: a [no, yes] score against the LM head's own
  logits for the two tokens at the prompt's last position (read through generation's
  logprobs: their difference is the logits' difference);
- the refusals: generation on a checkpoint with no LM head, normalize/dimensions, a score on a
  many-label classifier, tokens that are not one token, a soft-capped model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForSequenceClassification

from engine.config import ConfigError, ModelConfig
from engine.llm import LLM
from engine_api.classify import probabilities
from engine_api.errors import EngineInputError
from engine_api.pooling_params import PoolerConfig, PoolingParams
from engine_api.sampling_params import SamplingParams
from tests.support.engine_driver import greedy, tiny_llm
from tests.support.tiny_models import TINY_ARCH, _randomize

PROMPTS = [[(11 * j + 5) % 380 + 2 for j in range(29)], [7, 300, 12, 99, 5], [42],
           [(13 * j + 1) % 380 + 2 for j in range(17)]]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = Qwen3Config(**TINY_ARCH, rope_theta=1e6, head_dim=32, tie_word_embeddings=False,
                         id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    model = Qwen3ForSequenceClassification(config)
    _randomize(model, seed=7)
    path = tmp_path_factory.mktemp("tiny_qwen3_cls")
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_config_reads_the_labels() -> None:
    base = {"architectures": ["Qwen3ForSequenceClassification"], "vocab_size": 10,
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}
    cfg = ModelConfig.from_hf_dict({**base, "id2label": {"1": "yes", "0": "no"}})
    assert (cfg.architecture, cfg.class_labels, cfg.tie_word_embeddings) == (
        "Qwen3ForCausalLM", ("no", "yes"), True)
    assert ModelConfig.from_hf_dict({**base, "num_labels": 1}).class_labels == ("LABEL_0",)
    assert ModelConfig.from_hf_dict(base).class_labels == ("LABEL_0", "LABEL_1")
    assert cfg.to_hf_dict()["architectures"] == ["Qwen3ForSequenceClassification"]
    with pytest.raises(ConfigError, match=r"0\.\.1"):
        ModelConfig.from_hf_dict({**base, "id2label": {"0": "a", "2": "b"}})
    with pytest.raises(ConfigError, match="BertForCausalLM is not"):
        ModelConfig.from_hf_dict({**base, "architectures": ["BertForSequenceClassification"]})


def test_sequence_classifier_matches_transformers(classifier_dir: Path) -> None:
    ref = Qwen3ForSequenceClassification.from_pretrained(
        classifier_dir, attn_implementation="eager", dtype=torch.float32).eval()
    llm = tiny_llm(classifier_dir, max_num_batched_tokens=16)   # the long prompts in chunks
    assert llm.engine.class_labels == ("negative", "neutral", "positive")
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS])
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        got = torch.tensor(out.outputs.logits)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want.softmax(-1),
                                   atol=1e-5, rtol=1e-4)
        assert out.outputs.num_classes == 3 and out.prompt_token_ids == prompt
    # No LM head: generation is refused, and so are the embedding-only options.
    with pytest.raises(EngineInputError, match="no LM head"):
        llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(2))
    with pytest.raises(EngineInputError, match="normalize and dimensions"):
        llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=True))
    with pytest.raises(EngineInputError, match="normalize and dimensions"):
        llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=4))
    with pytest.raises(EngineInputError, match="3 labels"):
        llm.score("a", "b")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # cached blocks are free too


def test_a_split_classifier_matches(classifier_dir: Path) -> None:
    """Tensor parallelism, two ranks (CPU, Gloo): the head is replicated, the pooled state is
    the whole model's, so the logits are the unsplit engine's."""
    one = tiny_llm(classifier_dir).classify([{"prompt_token_ids": p} for p in PROMPTS])
    llm = tiny_llm(classifier_dir, tensor_parallel_size=2, cpu_threads=1)
    try:
        two = llm.classify([{"prompt_token_ids": p} for p in PROMPTS])
    finally:
        llm.shutdown()
    for a, b in zip(one, two, strict=True):
        assert b.outputs.logits == pytest.approx(a.outputs.logits, abs=1e-5)


def test_a_one_label_head_scores_pairs(classifier_dir: Path, tmp_path: Path) -> None:
    """num_labels 1 (a cross-encoder's head): `score` is its sigmoid on the pair as one input."""
    torch.manual_seed(1)
    config = Qwen3Config(**TINY_ARCH, rope_theta=1e6, head_dim=32, tie_word_embeddings=False,
                         num_labels=1)
    model = Qwen3ForSequenceClassification(config)
    _randomize(model, seed=8)
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = tiny_llm(tmp_path)
    [out] = llm.classify({"prompt_token_ids": PROMPTS[0]})
    with torch.no_grad():
        want = model(torch.tensor([PROMPTS[0]])).logits[0, 0].item()
    assert out.outputs.logits == pytest.approx([want], abs=2e-5)
    assert out.outputs.probs == pytest.approx([1 / (1 + math.exp(-want))], abs=1e-6)


def test_classifier_from_token_is_the_lm_heads_yes_minus_no(smollm2: LLM,
                                                            smollm2_yes_no: LLM) -> None:
    tok = smollm2.engine.tokenizer
    assert tok is not None
    no, yes = (tok.encode(t, add_special_tokens=False) for t in ("no", "yes"))
    assert len(no) == len(yes) == 1
    llm = smollm2_yes_no  # the session's engine: classifier_from_token=["no", "yes"]
    assert llm.engine.class_labels == ("yes",)
    queries = ["Is Paris the capital of France? Answer:", "Is two larger than three? Answer:"]
    scores = llm.score(queries[0], ["Paris is the capital.", "Bananas are yellow."])
    pairs = [tok.encode_pair(queries[0], d) for d in ("Paris is the capital.",
                                                     "Bananas are yellow.")]
    assert [s.prompt_token_ids for s in scores] == pairs
    for pair, s in zip(pairs, scores, strict=True):
        # The LM head's view of the same position (each answer appended, scored as a prompt
        # token): logprob differences are logit differences.
        lp = {}
        for answer in (no[0], yes[0]):
            [gen] = smollm2.generate({"prompt_token_ids": [*pair, answer]}, SamplingParams(
                temperature=0.0, max_tokens=1, prompt_logprobs=0))
            assert gen.prompt_logprobs is not None
            last = gen.prompt_logprobs[-1]
            assert last is not None and last.token_id == answer
            lp[answer] = last.logprob
        diff = lp[yes[0]] - lp[no[0]]
        assert s.outputs.score == pytest.approx(1 / (1 + math.exp(-diff)), abs=2e-4)
    [c] = llm.classify(queries[1])
    assert c.outputs.probs == pytest.approx(probabilities(c.outputs.logits))
    # The model still generates (it is a causal LM with its head).
    assert len(llm.generate(queries[1], greedy(2))[0].outputs[0].token_ids) == 2


def test_classifier_from_token_refusals(tiny_model_dirs: dict[str, Path],
                                        classifier_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not one"):
        LLM(num_gpu_blocks=64, device="cpu", classifier_from_token=["no", "definitely"])
    with pytest.raises(ConfigError, match="distinct"):
        PoolerConfig(classifier_from_token=("yes", "yes")).validate()
    with pytest.raises(ConfigError, match="own classification head"):
        tiny_llm(classifier_dir, classifier_from_token=["a", "b"])
    with pytest.raises(ConfigError, match="tokenizer"):
        tiny_llm(tiny_model_dirs["qwen3"], classifier_from_token=["a", "b"])


def test_gemma2_soft_cap_refused(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from engine.classifier import token_classifier

    cfg = ModelConfig.from_hf_dict(json.loads((tiny_model_dirs["gemma2"] / "config.json")
                                              .read_text()))
    with pytest.raises(ConfigError, match="soft-capped"):
        token_classifier(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size), [1, 2], ["a", "b"])


def test_the_flag_reaches_the_pooler_config() -> None:
    import argparse

    from engine.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).pooler.classifier_from_token == ()
    config = engine_config_from_args(parser.parse_args(["--classifier-from-token", "no,yes"]))
    assert config.pooler.classifier_from_token == ("no", "yes")
    bad = engine_config_from_args(parser.parse_args(["--classifier-from-token", "no,,yes"]))
    with pytest.raises(ConfigError, match="distinct"):   # as the engine checks it at start
        bad.pooler.validate()
