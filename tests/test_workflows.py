"""The project's own automation is checked like its code: the GitHub workflow is valid (its JSON schema),
passes zizmor's security audit offline (pinned actions, no persisted credentials, no template injection),
and every `make` target it, the README or the docs name exists (`make -n`, which runs nothing).

A workflow step calling a target that does not exist fails only after everything before it ran (the
publish step once pushed ddp, then stopped at `make test-images-all`, which never existed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.runs import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = VENV_BIN / name
    assert path.exists() or shutil.which(name), f"{name} is not installed: make venv (requirements/cpu.txt) installs it"
    return str(path) if path.exists() else shutil.which(name)


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_workflow_matches_the_github_workflow_schema(workflow):
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(workflow)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_workflow_passes_zizmor_offline(workflow):
    result = subprocess.run([tool("zizmor"), "--offline", str(workflow)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "No findings to report" in result.stdout, result.stdout + result.stderr


def make_invocations() -> list[str]:
    """Every `make ...` command line in the workflows' run steps and the shell blocks and code of the README and
    the docs' pages, with the
    loop variable of `for image in ...; do make "push-$image"` expanded and placeholders dropped."""
    texts = [w.read_text() for w in WORKFLOWS]
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:  # the README and the docs' pages
        text = page.read_text()
        texts += re.findall(r"```bash\n(.*?)```", text, re.S)
        texts += re.findall(r"`(make [^`]+)`", text)  # `make docs` in a sentence
    found = set()
    for text in texts:
        for match in re.finditer(r"(?:^|[;&|]\s*|\bdo\s+)make\s+([^#;&|\n]*)", text, re.M):
            words = [w.strip('"') for w in match.group(1).split()]
            words = [w for w in words if "<" not in w and "..." not in w and not w.startswith("$(")]
            if not words:
                continue
            words = [w for w in words if not w.startswith("-")]  # `make -n`: an option, not a target
            if not words:
                continue
            line = re.sub(r"-IMAGE\b", "-ddp", " ".join(words).replace("$image", "ddp"))  # pull-IMAGE: any image
            found.update(part.strip() for part in line.split(" / "))  # "make a / b": the README's alternatives
    return sorted(found)


def test_the_scan_finds_the_make_calls():
    calls = make_invocations()
    assert "test" in calls and any(call.startswith("push-ddp") for call in calls), calls


@pytest.mark.parametrize("call", make_invocations())
def test_every_make_target_named_in_the_workflows_and_readme_exists(call):
    result = subprocess.run(["make", "-n", *call.split()], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "No rule to make target" not in result.stderr and result.returncode == 0, f"make {call}: {result.stderr}"
