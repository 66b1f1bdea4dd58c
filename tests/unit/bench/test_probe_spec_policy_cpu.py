"""tools/probes/probe_spec_policy.py's paired ratio: the policy against the best other mode
round by round (they ran back to back), so a round that was slow for every mode does not read
as a loss of the policy."""

from __future__ import annotations

import pytest

from tools.probes.probe_spec_policy import paired_ratio


def test_paired_ratio_follows_the_rounds() -> None:
    # Round 2 ran on a busy machine: both modes at half speed. The means' ratio is 0.9 either
    # way; each round's ratio is 0.9 too, so the error is 0.
    runs = {"policy": [90.0, 45.0, 90.0], "suffix": [100.0, 50.0, 100.0], "off": [1.0] * 3}
    p = paired_ratio(runs, "suffix")
    assert p["vs"] == "suffix" and p["by_round"] == [0.9, 0.9, 0.9]
    assert p["mean"] == pytest.approx(0.9) and p["sem"] == 0.0
    # A policy that lost in one round only: mean (1.0 + 0.7 + 1.0) / 3, sem of those.
    q = paired_ratio({"policy": [100.0, 70.0, 100.0], "suffix": [100.0] * 3}, "suffix")
    assert q["mean"] == pytest.approx(0.9) and q["sem"] == pytest.approx(0.1)
    assert paired_ratio({"policy": [5.0], "suffix": [10.0]}, "suffix")["sem"] == 0.0
