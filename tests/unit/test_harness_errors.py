"""recipes/harness/errors.py: the one line a rank writes reaches the log whole."""

from __future__ import annotations

import os
import re
import subprocess
import sys


from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))


def test_lines_of_ranks_printing_at_once_never_run_into_each_other():
    """Four unbuffered processes writing 2000 error lines each into one pipe, as ranks do into one job log:
    every line arrives whole (print() would write text and newline separately, and lines would merge)."""
    writer = ("import sys; sys.path.insert(0, sys.argv[1]); import harness\n"
              "for i in range(2000): harness.stderr_line(f'[rank {sys.argv[2]}] error: the same long message, ' + 'x' * 200)")
    script = " & ".join(f"{sys.executable} -c \"{writer}\" {REPO / 'recipes'} {rank}" for rank in range(4))
    result = subprocess.run(["bash", "-c", f"{{ {script} & wait; }} 2>&1"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=120)
    lines = result.stdout.splitlines()
    assert len(lines) == 8000
    assert all(re.fullmatch(r"\[rank \d\] error: the same long message, x{200}", line) for line in lines)
