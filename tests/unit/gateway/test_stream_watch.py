"""How long a call may go without an answer before its worker's health is asked
(gateway/stream_watch.py): its measured step time, never under the floor."""

from __future__ import annotations

from gateway.stream_watch import STALL_STEPS, stall_after_s
from protos.splitserve.v1 import common_pb2


def test_the_stall_time_follows_the_measured_step_time() -> None:
    unmeasured = common_pb2.LoadReport()
    assert stall_after_s(unmeasured, 2.0) == 2.0
    fast = common_pb2.LoadReport(spec_step_cost=[common_pb2.SpecStepCost(rows=1, seconds=0.01)])
    assert stall_after_s(fast, 2.0) == 2.0
    slow = common_pb2.LoadReport(spec_step_cost=[
        common_pb2.SpecStepCost(rows=8, seconds=0.5), common_pb2.SpecStepCost(rows=1, seconds=0.2)])
    assert stall_after_s(slow, 2.0) == STALL_STEPS * 0.2  # its one-row step, not a wide one
