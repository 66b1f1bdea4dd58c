"""gRPC fuzzing of the real workers (bench/grpc_fuzz.py) on the shared disaggregated stack:
random, truncated and bit-flipped requests to every worker method, and Decode calls with forged
KV handles (unknown lease, another address, wrong hashes, another tenant's salt). No INTERNAL or
UNKNOWN answer, no dead engine, every engine back to idle, and the stack still serves the
reference tokens."""

from __future__ import annotations

import pytest

from bench.grpc_fuzz import FuzzReport, fuzz_forged_handles, fuzz_worker
from rpc.auth import bearer_metadata
from tests.support.e2e_stack import (
    HOST,
    ORACLE_MAX_TOKENS,
    Generated,
    Stack,
    generate,
)

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow


def test_grpc_fuzz_and_forged_handles(disagg_stack: Stack, prompts: list[list[int]],
                                      oracle: list[Generated]) -> None:
    disagg_stack.wait_idle()
    auth = bearer_metadata(disagg_stack.internal_token)
    report = FuzzReport()

    def alive() -> bool:
        return all(w.aengine is not None and w.aengine.dead is None
                   for w in disagg_stack.workers.values())

    addresses = {role: f"{HOST}:{w.port}" for role, w in disagg_stack.workers.items()}
    for seed, role in enumerate(("prefill", "decode")):
        fuzz_worker(addresses[role], rounds=2, seed=seed, report=report, alive=alive,
                    metadata=auth)
    fuzz_forged_handles(addresses["prefill"], addresses["decode"], report, alive, auth)
    assert report.cases >= 50 and not report.failures, report.summary()
    disagg_stack.wait_idle()
    out = generate(disagg_stack.grpc_target, prompts[0], ORACLE_MAX_TOKENS)
    assert out.token_ids == oracle[0].token_ids
