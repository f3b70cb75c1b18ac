"""The repository's top-level ``kernels/`` folder never stands in for an installed ``kernels``
package (HuggingFace's, imported by transformers in some set-ups) when the tests run from the
root as ``python -m pytest``, which puts the working directory on ``sys.path``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_pytest_from_the_root_imports_the_installed_kernels_package(tmp_path):
    stub = tmp_path / "site" / "kernels"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("STUB_DISTRIBUTION = True\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(Path("tests") / "integrations" / "import_probe.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
