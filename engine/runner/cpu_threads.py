"""The intra-op thread count of a CPU engine."""

from __future__ import annotations

import logging

import torch

from engine_api.cpus import available_cpus

log = logging.getLogger(__name__)


def set_cpu_threads(explicit: int | None) -> None:
    """`explicit` threads when given (`--cpu-threads`); otherwise torch's default capped by the
    CPUs this process may use (engine_api/cpus.py): torch sizes its pool from the host's cores,
    which under a cgroup quota oversubscribes the CPUs the container really has."""
    if explicit:
        torch.set_num_threads(explicit)
        return
    usable = available_cpus()
    if torch.get_num_threads() > usable:
        log.info("CPU threads: %d (the CPUs this process may use), not torch's %d", usable,
                 torch.get_num_threads())
        torch.set_num_threads(usable)
