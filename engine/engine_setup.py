"""What `LLMEngine` derives from its configuration and model at start-up, besides the runner
and the scheduler: end-of-sequence ids, speculative proposers, a classification head, and
whether to schedule asynchronously."""

from __future__ import annotations

import torch

from engine.classifier import Classifier, head_classifier, token_classifier
from engine.config import ConfigError, EngineConfig, ModelConfig, PoolerConfig
from engine.draft_model import DraftModelProposer
from engine.model.llama import LlamaForCausalLM
from engine.spec import Proposer
from engine.spec.ngram import NgramProposer
from engine.spec.suffix import SuffixProposer
from engine_api.tokenizer import Tokenizer


def eos_ids(model_config: ModelConfig, generation_config: dict[str, object],
            tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Every id that ends a sequence: the model config's, generation_config.json's and the
    tokenizer's, sorted."""
    ids = set(model_config.eos_token_ids)
    gen = generation_config.get("eos_token_id")
    if isinstance(gen, int):
        ids.add(gen)
    elif isinstance(gen, list):
        ids.update(int(x) for x in gen)
    if tokenizer is not None:
        ids.update(tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def make_proposers(config: EngineConfig, cfg: ModelConfig, max_model_len: int
                   ) -> dict[str, Proposer]:
    """The configured method's proposer first; beside it n-gram lookup and suffix decoding,
    which cost nothing to hold (no weights; a suffix tree only for requests that use it), so
    the gateway can choose per request (cheaper drafts at a load where a draft model's steps
    no longer pay, suffix decoding where outputs repeat across requests)."""
    spec = config.speculative
    if not spec.enabled or config.scheduler.role == "prefill":
        return {}
    proposers: dict[str, Proposer] = {}
    if spec.method == "draft_model":
        proposers["draft_model"] = DraftModelProposer(config, cfg.vocab_size, max_model_len)
    suffix = SuffixProposer(spec.suffix_decoding_max_tree_depth,
                            spec.suffix_decoding_max_spec_factor,
                            spec.suffix_decoding_min_token_prob,
                            spec.suffix_decoding_max_cached_requests)
    ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        proposers["suffix"] = suffix
    proposers["ngram"] = ngram
    proposers.setdefault("suffix", suffix)
    return proposers


def make_classifier(pooler: PoolerConfig, cfg: ModelConfig, model: LlamaForCausalLM,
                    tokenizer: Tokenizer | None) -> Classifier | None:
    """The checkpoint's classification head, or the LM head's rows for
    `pooler.classifier_from_token` (engine/classifier.py); None for neither."""
    tokens = pooler.classifier_from_token
    if cfg.is_classifier:
        if tokens:
            raise ConfigError("classifier_from_token: this checkpoint has its own "
                              f"classification head ({cfg.architecture} with labels)")
        return head_classifier(cfg, model.score.weight)  # type: ignore[union-attr]
    if not tokens:
        return None
    if tokenizer is None:
        raise ConfigError("classifier_from_token needs the model's tokenizer")
    ids = []
    for token in tokens:
        found = tokenizer.encode(token, add_special_tokens=False)
        if len(found) != 1:
            raise ConfigError(f"classifier_from_token: {token!r} is {len(found)} tokens "
                              f"({found[:8]}), not one")
        ids.append(found[0])
    return token_classifier(cfg, model.lm_head_weight, ids, tokens)


def resolve_async(config: EngineConfig, device: torch.device) -> bool:
    """Async scheduling pays where the device runs apart from the host (CUDA); the prefill
    role hands each request off after one token, so there is nothing to overlap there."""
    wanted = config.scheduler.async_scheduling
    if config.scheduler.role == "prefill":
        return False
    return device.type == "cuda" if wanted is None else wanted
