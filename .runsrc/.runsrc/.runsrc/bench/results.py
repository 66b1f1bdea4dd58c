"""JSON results: the numbers plus where they came from (commit, machine, versions, settings)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_info(repo_root: Path = REPO_ROOT) -> dict[str, Any]:
    """{"commit": sha or None, "dirty": bool or None}.

    $SPLITSERVE_COMMIT, when set, names the commit and `dirty` is None (unknown): on the
    accelerator machine the tree is a copy, and a `.git` found above it may be a stale one.
    """
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=repo_root, capture_output=True, text=True,
                                 timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    named = os.environ.get("SPLITSERVE_COMMIT")
    if named:
        return {"commit": named, "dirty": None}
    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(0))


def environment_info() -> dict[str, Any]:
    """The machine and software a result was measured on."""
    return {
        **git_info(),
        "hostname": socket.gethostname(),
        "cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }


def build_result(benchmark: str, model: str, settings: dict[str, Any],
                 metrics: dict[str, Any]) -> dict[str, Any]:
    """One result document: `benchmark` names the subcommand (online/offline/hf-baseline)."""
    return {
        "benchmark": benchmark,
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": model,
        "environment": environment_info(),
        "settings": settings,
        "metrics": metrics,
    }


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    """Write atomically (temp file + rename) so a killed run never leaves half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(target)
    return target
