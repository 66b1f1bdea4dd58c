"""How many CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota.

A container limited to 2 CPUs by a CFS quota (Kubernetes `resources.limits.cpu`, `docker
--cpus`) still sees every core of its host in `os.cpu_count()` and often in its affinity mask,
so a thread pool sized from either (torch's intra-op pool, OpenMP's) runs tens of spinning
threads on 2 CPUs' worth of time: small CPU ops then get many times slower. The CPU engine and
`splitserve up` size their threads from this count instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup's CPU quota in CPUs (quota / period), or None when there is none or it cannot
    be read. `root` is the cgroup file system's mount point (tests pass a fake tree)."""
    v2 = root / _CGROUP_V2.relative_to("/sys/fs/cgroup")
    try:
        quota, period = v2.read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / _CGROUP_V1_QUOTA.relative_to("/sys/fs/cgroup")).read_text())
        period_us = int((root / _CGROUP_V1_PERIOD.relative_to("/sys/fs/cgroup")).read_text())
    except (OSError, ValueError):
        return None
    if quota_us <= 0 or period_us <= 0:  # -1: no quota
        return None
    return quota_us / period_us


def available_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask (all CPUs where the OS has no such call),
    capped by the cgroup quota rounded up; at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        count = min(count, max(1, math.ceil(limit)))
    return max(1, count)
