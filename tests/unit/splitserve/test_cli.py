"""The `splitserve` command line: dispatch, `generate` on the embedded model, and its errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "splitserve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands_and_unknown_command_fails() -> None:
    ok = _run("--help")
    assert ok.returncode == 0
    for command in ("generate", "serve", "up", "bench"):
        assert command in ok.stdout
    bad = _run("frobnicate")
    assert bad.returncode == 2
    assert "unknown command 'frobnicate'" in bad.stderr


def test_generate_chat_answers_paris() -> None:
    out = _run("generate", "--chat", "What is the capital of France?", "--max-tokens", "16",
               "--max-model-len", "512", "--cpu-threads", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout


def test_generate_rejects_bad_sampling_with_a_named_field() -> None:
    out = _run("generate", "hi", "--temperature", "-1", timeout=60)
    assert out.returncode == 2
    assert "temperature" in out.stderr


def test_serve_gateway_role_does_not_import_torch() -> None:
    code = ("import sys; from splitserve.cli import main; "
            "import splitserve.serve as w; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    # worker_main's module scope imports only engine.cli_args (torch-free config flags).
    assert out.stdout.strip() == "False"
