"""The Python code passes ruff (pinned in requirements/cpu.txt, configured in pyproject.toml: pycodestyle's
errors and warnings and pyflakes, lines up to 140), and the configuration is live: a file with an undefined
name and an unused import is caught."""

from __future__ import annotations

import shutil
import subprocess

from support.runs import REPO


def ruff() -> str:
    path = shutil.which("ruff")  # (make test puts .venv/bin first on PATH)
    assert path, "ruff is not installed: make venv (requirements/cpu.txt) installs it"
    return path


def test_ruff_finds_nothing_in_the_project():
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_with_the_projects_configuration_catches_a_defect():
    broken = "import os\n\n\ndef f():\n    return undefined_name\n" + "x = 1  # " + "long " * 30 + "\n"
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "--stdin-filename", "recipes/x.py", "-"],
                            cwd=REPO, input=broken, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert all(code in result.stdout for code in ("F401", "F821", "E501")), result.stdout
