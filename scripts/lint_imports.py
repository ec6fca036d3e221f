"""Checks the import layers (pyproject's [tool.importlinter]) on the package as it installs.

The services' folders are mapped into the ``kvmesh`` namespace by pyproject's package-dir, which
import-linter cannot follow in the source tree. So this lays the package out as a wheel would
(setuptools ``build_py`` into a temp dir) and runs ``lint-imports`` on that copy.

Run: .venv/bin/python scripts/lint_imports.py  (part of `make lint`)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvmesh-lint-") as staged:
        build = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", "import setuptools; setuptools.setup()", "-q",
             "build_py", "--build-lib", staged],
            cwd=ROOT, capture_output=True, text=True,
        )
        if build.returncode != 0:
            sys.stderr.write(build.stdout + build.stderr)
            return build.returncode
        env = {**os.environ, "PYTHONPATH": staged}
        lint = Path(sys.executable).with_name("lint-imports")
        return subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=staged, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
