"""The CPUs a process may use, from its affinity and a cgroup quota (engine_api/cpus.py), read
from fake cgroup trees of both versions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_api.cpus import available_cpus, cgroup_cpu_limit


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(("files", "want"), [
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
    ({"cpu.max": "garbage\n"}, None),
])
def test_the_quota_of_either_cgroup_version(tmp_path: Path, files: dict[str, str],
                                            want: float | None) -> None:
    assert cgroup_cpu_limit(_tree(tmp_path, files)) == want


def test_a_quota_caps_the_affinity_mask_rounded_up(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    root = _tree(tmp_path, {"cpu.max": "50000 100000\n"})  # half a CPU: one thread
    assert available_cpus(root) == 1
    root = _tree(tmp_path, {"cpu.max": f"{(mask + 8) * 100000} 100000\n"})  # above the mask
    assert available_cpus(root) == mask
