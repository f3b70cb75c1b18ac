"""The README's "Use doracheck in your CI" recipe, followed as printed in an empty project: its
``pyproject.toml`` snippet, a package of the user's, and its pytest command. doracheck comes from
this environment (installed as step 2 says; a fresh venv per test run would cost a torch
install). A correct implementation passes; a wrong one fails with the property named."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

CORRECT = "from doracheck import dora_linear  # noqa: F401\n"
# The bias inside the normalised branch: y = g ⊙ (x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ).
WRONG = '''import doracheck


def dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, bias=None, **kwargs):
    y = doracheck.dora_linear(x, weight, lora_A, lora_B, magnitude, scaling, None, **kwargs)
    if bias is None:
        return y
    n = doracheck.factored_norm(weight, lora_A, lora_B, scaling, fan_in_fan_out=kwargs.get("fan_in_fan_out", False))
    return y + (magnitude / n.clamp_min(1e-12)).to(y.dtype) * bias
'''


def recipe() -> tuple[str, list[str]]:
    """(the pyproject.toml snippet, the pytest command) as the README prints them."""
    section = README.read_text().split("### Use doracheck in your CI", 1)[1]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    command = re.search(r"Run `(pytest --doracheck-impl [^`]+)`", section).group(1)
    return "\n".join(line.strip() for line in toml.splitlines()), shlex.split(command)


def run_recipe(project: Path, implementation: str) -> subprocess.CompletedProcess:
    toml, command = recipe()
    (project / "pyproject.toml").write_text(f'[project]\nname = "my-pkg"\nversion = "0"\n\n{toml}\n')
    package = project / "my_pkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "dora.py").write_text(implementation)
    pytest_script = Path(sys.executable).with_name("pytest")  # the venv's pytest, as an activated venv runs it
    assert command[0] == "pytest" and pytest_script.exists()
    return subprocess.run([str(pytest_script), *command[1:], "-p", "no:cacheprovider"], cwd=project, capture_output=True,
                          text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")})


@pytest.mark.parametrize("implementation", ["correct", "wrong"])
def test_the_readme_ci_recipe_works_as_printed(tmp_path, implementation):
    done = run_recipe(tmp_path, CORRECT if implementation == "correct" else WRONG)
    out = done.stdout + done.stderr
    if implementation == "correct":
        assert done.returncode == 0 and re.search(r"\d+ passed", out) and "failed" not in out, out[-3000:]
    else:
        assert done.returncode == 1, out[-3000:]
        assert re.search(r"FAILED .*test_doracheck\[(accuracy|forward\.\w+)", out), out[-3000:]
