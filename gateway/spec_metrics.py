"""Speculative decoding on the gateway's /metrics and spans: the policy's choices per decode
worker (gateway/spec_policy.py), and what each worker reports of its trade (LoadReport):
its step cost by query rows, its acceptance per proposer and request class, its own drafting
decisions per round (the drafts its step budget allowed, the pauses it began), and vLLM's
cumulative counters (`spec_decode_num_drafts`, `spec_decode_num_accepted_tokens_per_pos`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine_api.spec_gain import Acceptance
from gateway.spec_policy import SpecDecision
from protos.splitserve.v1 import common_pb2

_LABELS = ("role", "worker")
_GAIN_BUCKETS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0)
_METHOD_NAMES = {common_pb2.SPECULATIVE_METHOD_NGRAM: "ngram",
                 common_pb2.SPECULATIVE_METHOD_SUFFIX: "suffix",
                 common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL: "draft_model"}


def spec_attributes(spec: SpecDecision) -> dict[str, str | int | float]:
    """The decision and its inputs, for the request's span."""
    return {"splitserve.num_speculative_tokens": spec.num_speculative_tokens,
            "splitserve.speculative_method": spec.label,
            "splitserve.speculative_class": spec.request_class,
            "splitserve.speculative_reason": spec.reason,
            "splitserve.speculative_predicted_k": spec.predicted_k,
            "splitserve.speculative_predicted_gain": round(spec.predicted_gain, 4),
            "splitserve.speculative_step_seconds": spec.step_seconds,
            "splitserve.speculative_accepted_per_step": round(spec.accepted_per_step, 4),
            "splitserve.decode_worker_load": spec.load}


class SpecWorkerCollector:
    """Per decode worker, from its last load report (healthy or not: counters are totals)."""

    def __init__(self) -> None:
        self._samples: dict[str, tuple[tuple[str, common_pb2.LoadReport], ...]] = {}

    def update(self, role: str, reports: Iterable[tuple[str, common_pb2.LoadReport]]) -> None:
        self._samples = self._samples | {role: tuple(reports)}

    def describe(self) -> Iterator[Metric]:
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        return self._families(self._samples)

    @staticmethod
    def _families(samples: Mapping[str, Sequence[tuple[str, common_pb2.LoadReport]]]
                  ) -> Iterator[Metric]:
        drafts = CounterMetricFamily(
            "splitserve:spec_decode_num_drafts",
            "Verify steps with drafts (per sequence), as vLLM counts them.", labels=_LABELS)
        per_pos = CounterMetricFamily(
            "splitserve:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each draft position (0: the first), as vLLM counts them.",
            labels=(*_LABELS, "position"))
        cost = GaugeMetricFamily(
            "splitserve:spec_decode_step_seconds",
            "The worker's measured decode step time by query rows (a verifying sequence is "
            "1 + drafts rows), plain and verify steps apart: what the speculation policy "
            "weighs.", labels=(*_LABELS, "rows", "step"))
        accepted = GaugeMetricFamily(
            "splitserve:spec_decode_accepted_per_step",
            "Drafts accepted per step of a speculating request at the worker's cap (smoothed), "
            "by proposer and request class.", labels=(*_LABELS, "method", "request_class"))
        rounds = CounterMetricFamily(
            "splitserve:spec_decode_draft_rounds",
            "Drafting rounds of speculating requests by the drafts the worker's step budget "
            "allowed them (0: held at none; the gateway's cap where the budget did not lower "
            "it), per proposer and request class.",
            labels=(*_LABELS, "method", "request_class", "num_speculative_tokens"))
        pauses = CounterMetricFamily(
            "splitserve:spec_decode_pauses",
            "Pauses from drafting the worker began for requests whose recent drafts were "
            "accepted too rarely, per proposer and request class.",
            labels=(*_LABELS, "method", "request_class"))
        for role, reports in samples.items():
            for worker, r in reports:
                if not (r.max_speculative_tokens or r.spec_num_drafts):
                    continue
                drafts.add_metric([role, worker], float(r.spec_num_drafts))
                for i, n in enumerate(r.spec_accepted_tokens_per_pos):
                    per_pos.add_metric([role, worker, str(i)], float(n))
                for p in r.spec_step_cost:
                    cost.add_metric([role, worker, f"{p.rows:.1f}",
                                     "verify" if p.verify else "plain"], p.seconds)
                for a in r.spec_acceptance:
                    tokens, _ = Acceptance(a.steps, tuple(a.drafted), tuple(a.accepted)
                                           ).tokens_and_rows(len(a.drafted))
                    accepted.add_metric([role, worker, _METHOD_NAMES.get(a.method, "other"),
                                         a.request_class or "none"], tokens - 1.0)
                for d in r.spec_draft_rounds:
                    rounds.add_metric([role, worker, _METHOD_NAMES.get(d.method, "other"),
                                       d.request_class or "none",
                                       str(d.num_speculative_tokens)], float(d.rounds))
                for q in r.spec_pauses:
                    pauses.add_metric([role, worker, _METHOD_NAMES.get(q.method, "other"),
                                       q.request_class or "none"], float(q.pauses))
        yield from (drafts, per_pos, cost, accepted, rounds, pauses)


class SpecMetrics:
    """The policy's decisions (counted per worker) and the workers' reported trade."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "splitserve:spec_decode_policy_decisions",
            "Decode calls by the speculation policy's choice per worker: proposer (off: no "
            "drafts), drafts per step at most, request class, and why (measured, explore, "
            "threshold, always, off).",
            ["worker", "method", "num_speculative_tokens", "request_class", "reason"],
            registry=registry)
        self.predicted_gain = Histogram(
            "splitserve:spec_decode_predicted_gain",
            "The batch's predicted tokens/s over plain decoding's for the adaptive policy's "
            "measured choices (1: off).", buckets=_GAIN_BUCKETS, registry=registry)
        self.workers = SpecWorkerCollector()
        registry.register(self.workers)

    def observe_decision(self, worker: str, spec: SpecDecision) -> None:
        self.decisions.labels(worker=worker, method=spec.label,
                              num_speculative_tokens=str(spec.num_speculative_tokens),
                              request_class=spec.request_class or "none",
                              reason=spec.reason).inc()
        if spec.reason == "measured":
            self.predicted_gain.observe(spec.predicted_gain)
