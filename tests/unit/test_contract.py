"""What the launcher and the recipes say to each other is written once on each side (slurm/lib/contract.sh,
recipes/harness/contract.py) and held equal here: exit codes, the stop marker, the environment the launcher
exports to the ranks. A name changed on one side only fails this test, not a job."""

from __future__ import annotations

import re
import subprocess
import sys

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
from harness import contract  # noqa: E402

SLURM = REPO / "slurm"


def bash_contract() -> dict[str, str]:
    """contract.sh's values as bash itself sees them after sourcing it."""
    names = ("EXIT_BAD_INPUT", "EXIT_COLLECTIVE_FAILED", "STOP_MARKER")
    script = f'source "{SLURM}/lib/contract.sh"; ' + "; ".join(f'echo "{name}=${{{name}}}"' for name in names)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def test_exit_codes_and_the_stop_marker_are_the_same_on_both_sides():
    assert bash_contract() == {"EXIT_BAD_INPUT": str(contract.EXIT_BAD_INPUT),
                               "EXIT_COLLECTIVE_FAILED": str(contract.EXIT_COLLECTIVE_FAILED),
                               "STOP_MARKER": contract.STOP_MARKER}
    # ... and nothing else in the launcher spells them out
    for path in (SLURM / "lib").glob("*.sh"):
        if path.name != "contract.sh":
            assert contract.STOP_MARKER not in path.read_text(), f"{path}: use $STOP_MARKER"
    launcher = (SLURM / "lib" / "launch.sh").read_text()
    assert '"$RUN_DIR/$STOP_MARKER"' in launcher and '"$EXIT_BAD_INPUT")' in launcher


def test_every_variable_the_recipes_read_from_the_launcher_is_set_by_it():
    launcher = "\n".join(path.read_text() for path in [*SLURM.glob("lib/*.sh"), SLURM / "preflight.sh"])
    names = {value for name, value in vars(contract).items() if name.endswith("_ENV")}
    assert len(names) >= 6
    for name in names:
        # exported, assigned, or passed to the containers by its value ('-e HPCML_*' passes them all there)
        assert re.search(rf"(export |\b){name}=|\${{{name}[:}}-]|\${name}\b", launcher), f"{name}: not set by slurm/"
    # and the recipes' side reads them through contract.py only (one spelling)
    for path in (REPO / "recipes" / "harness").glob("*.py"):
        if path.name != "contract.py":
            text = path.read_text()
            assert not [name for name in names if f'"{name}"' in text], f"{path}: use harness/contract.py's name"
