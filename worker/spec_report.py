"""A decode worker's speculative decoding numbers for its LoadReport: the measured step cost,
the smoothed acceptance per proposer and request class, the worker's own drafting decisions
(drafts allowed per round, pauses), and vLLM's cumulative counters
(engine/spec/cost.py and stats.py measure them; the gateway's policy reads them)."""

from __future__ import annotations

from typing import Any

from engine.llm_engine import LLMEngine
from protos.splitserve.v1 import common_pb2
from worker.convert import SPEC_METHOD_ENUMS


def spec_report(engine: LLMEngine) -> dict[str, Any]:
    """LoadReport fields (keywords); none for an engine without speculation. Read off the
    engine thread (racy, as `stats`): the lists are copied first, so a report may be a step
    behind, never torn."""
    if not engine.proposers:
        return {}
    stats, rounds = engine.spec_stats, engine.spec_rounds
    # The step cost at the running batch's context with one more sequence of the recent mean
    # context: the batch a request the gateway sends here joins.
    kv_tokens = (sum(r.num_tokens for r in list(engine.scheduler.running))
                 + engine.spec_cost.context_per_sequence)
    return {
        "spec_step_cost": [common_pb2.SpecStepCost(rows=r, seconds=s, verify=verify)
                           for verify in (False, True)
                           for r, s in engine.spec_cost.points(kv_tokens, verify)],
        "spec_acceptance": [
            common_pb2.SpecAcceptance(method=SPEC_METHOD_ENUMS[m], request_class=c,
                                      steps=a.steps, drafted=a.drafted, accepted=a.accepted)
            for m, c, a in stats.items() if m in SPEC_METHOD_ENUMS],
        "max_speculative_tokens": engine.config.speculative.num_speculative_tokens,
        "spec_step_budget": engine.spec_budget is not None,
        "spec_verify_pad_rows": engine.spec_cost.verify_pad[0],
        "spec_verify_pad_max_seqs": engine.spec_cost.verify_pad[1],
        "spec_num_drafts": stats.num_drafts,
        "spec_accepted_tokens_per_pos": list(stats.accepted_per_pos),
        "spec_draft_rounds": [
            common_pb2.SpecDraftRounds(method=SPEC_METHOD_ENUMS[m], request_class=c,
                                       num_speculative_tokens=k, rounds=n)
            for (m, c, k), n in sorted(dict(rounds.allowed).items())
            if m in SPEC_METHOD_ENUMS],
        "spec_pauses": [
            common_pb2.SpecPauses(method=SPEC_METHOD_ENUMS[m], request_class=c, pauses=n)
            for (m, c), n in sorted(dict(rounds.pauses).items()) if m in SPEC_METHOD_ENUMS],
    }
