"""What the REST and gRPC front ends share: config, tokenizer, router, orchestrator, metrics,
stored responses, the bound on requests in flight."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

from gateway.admission import RequestLimit
from gateway.config import GatewayConfig
from gateway.lora_resolver import LoRAResolver
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.preprocess import Preprocessor
from gateway.response_store import ResponseStore
from gateway.router import Router, WorkerPool
from gateway.serving_mode import ServingMode
from gateway.tokenization import TokenizerLike, TokenTexts
from gateway.worker_health import HealthPolicy


@dataclass(slots=True)
class GatewayState:
    """One gateway's live objects. `draining` flips on shutdown (health reports 503)."""

    config: GatewayConfig
    tokenizer: TokenizerLike
    router: Router
    orchestrator: Orchestrator
    preprocessor: Preprocessor
    metrics: GatewayMetrics
    token_texts: TokenTexts  # each token's text, for logprobs
    responses: ResponseStore  # the Responses API's stored responses (this gateway's own)
    limit: RequestLimit  # generation and embeddings requests in flight (--max-concurrent-requests)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    # One runtime LoRA adapter load or unload at a time (gateway/lora_admin.py): one's undo
    # must not undo another's work on the same name.
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Adapters loaded when a request first names them (--lora-resolver-dir; None: off).
    lora_resolver: LoRAResolver | None = None
    # Adapters this gateway loaded at runtime (admin endpoint or resolver) -> their directory:
    # put back on a worker that lacks one (gateway/lora_admin.py `reconcile`), and the task
    # doing so.
    runtime_loras: dict[str, str] = field(default_factory=dict)
    reconcile_task: asyncio.Task[None] | None = None
    lora_gaps: dict[tuple[str, str], float] = field(default_factory=dict)  # (worker, adapter)
    # -> since when the worker lacks it
    _special: dict[str, bool] = field(default_factory=dict)
    _single: dict[str, int | None] = field(default_factory=dict)

    def lora_adapters(self) -> set[str]:
        """The LoRA adapters requests may name as their `model`: those every pool a request
        goes through has a healthy worker serving (decode, and prefill when disaggregated)."""
        pools = [p for p in (self.router.prefill, self.router.decode) if p is not None]
        if not pools:
            return set()
        return set.intersection(*(p.lora_adapters() for p in pools))

    def class_labels(self) -> tuple[str, ...] | None:
        """The model's classifier labels, as the workers that run pooling requests report them:
        () for an embedding model, None before any has reported."""
        return self.router.embed_pool.class_labels()

    def served_models(self) -> list[str]:
        """The names a request's `model` may take: the base model's, then the adapters'."""
        return [self.config.served_model_name, *sorted(self.lora_adapters())]

    def lora_name_for(self, model: str | None) -> str | None:
        """A request's `model`: "" for the base model (or none given), the adapter's name for
        a LoRA adapter the workers serve, None for anything else."""
        if model is None or model == self.config.served_model_name:
            return ""
        return model if model in self.lora_adapters() else None

    def is_special_text(self, text: str) -> bool:
        """Whether decoding that skips special tokens drops `text` (a parser's tag the tokenizer
        holds as a special token), found once per text."""
        known = self._special.get(text)
        if known is None:
            tok = self.tokenizer
            ids = tok.encode(text, add_special_tokens=False)
            known = self._special[text] = tok.decode(ids, skip_special_tokens=True) != text
        return known

    def token_id_of(self, text: str) -> int | None:
        """The one token `text` encodes to (a parser's tag: "</think>"), or None when it takes
        several; found once per text."""
        if text not in self._single:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self._single[text] = ids[0] if len(ids) == 1 else None
        return self._single[text]

    @classmethod
    def build(cls, config: GatewayConfig, tokenizer: TokenizerLike) -> GatewayState:
        """Wire the parts together (no I/O: call `router.start()` inside the loop)."""
        def pool(role: str, addresses: tuple[str, ...]) -> WorkerPool:
            return WorkerPool(role, addresses, poll_interval_s=config.load_poll_interval_s,  # type: ignore[arg-type]
                              poll_timeout_s=config.load_poll_timeout_s,
                              internal_token=config.internal_token,
                              discovery_interval_s=config.discovery_interval_s,
                              health=HealthPolicy(config.load_poll_max_misses,
                                                  config.liveness_timeout_s))

        router = Router(None if config.colocated else pool("prefill", config.prefill_addresses),
                        pool("decode", config.decode_addresses))
        metrics = GatewayMetrics(config.served_model_name, config.max_model_len)
        for p in (router.prefill, router.decode):
            if p is not None:
                p.add_listener(functools.partial(_observe_pool, metrics, p))
        vocab_size = getattr(tokenizer, "vocab_size", None)
        responses = ResponseStore(config.responses_store_max_entries,
                                  config.responses_store_max_bytes)
        metrics.observe_response_store(responses)
        limit = RequestLimit(config.max_concurrent_requests, metrics)
        resolver = None
        if config.lora_resolver_dir is not None:
            resolver = LoRAResolver(config.lora_resolver_dir)
        return cls(config=config, tokenizer=tokenizer, router=router,
                   orchestrator=Orchestrator(config, router, tokenizer, metrics, limit),
                   preprocessor=Preprocessor(config, tokenizer, vocab_size), metrics=metrics,
                   token_texts=TokenTexts(tokenizer), responses=responses, limit=limit,
                   lora_resolver=resolver)

    @property
    def healthy(self) -> bool:
        """Serving: not draining, and some worker answered its last load poll (workers refuse
        polls until their model is loaded) — any serving mode but `unavailable`: a lone pool
        serves whole requests (gateway/serving_mode.py)."""
        return not self.draining and self.orchestrator.modes.current() != ServingMode.UNAVAILABLE


def _observe_pool(metrics: GatewayMetrics, pool: WorkerPool) -> None:
    """Listener of a pool's poll rounds: mirror its workers' load reports into the metrics."""
    metrics.observe_workers(pool.role, pool.workers)
