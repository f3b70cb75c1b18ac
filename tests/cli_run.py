"""Run the installed ``doracheck`` command the way a user does: a subprocess in a folder of
the test's choosing, with CI set (no progress bars) and Python's warnings off. Returns the
completed process; ``no_traceback`` asserts that neither stream holds a Python traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def doracheck_command() -> list[str]:
    """The console script installed beside this interpreter (``pip install -e .`` puts it there)."""
    script = Path(sys.executable).with_name("doracheck")
    if script.exists():
        return [str(script)]
    found = shutil.which("doracheck")
    return [found] if found else [sys.executable, "-m", "doracheck"]


def run_cli(args: list[str], cwd: str | os.PathLike, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "CI": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([*doracheck_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    for stream in (proc.stdout, proc.stderr):
        assert "Traceback (most recent call last)" not in stream, stream[-3000:]


def snapshot(folder: str | os.PathLike) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (to assert that a command changed none)."""
    root = Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_clean(args: list[str], cwd: str | os.PathLike, **kwargs) -> subprocess.CompletedProcess:
    """``run_cli`` that also asserts there is no traceback in its output."""
    proc = run_cli(args, cwd, **kwargs)
    no_traceback(proc)
    return proc


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The command's single stderr line (asserted to be one line)."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def require_matplotlib() -> None:
    """Skip, saying why, where the optional report extra (matplotlib) is missing."""
    pytest.importorskip("matplotlib", reason="the HTML report needs matplotlib (the report extra)")
